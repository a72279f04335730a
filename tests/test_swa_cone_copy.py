"""Cone replay, forward side, on a small real DeepSeekV4TokenToKVPool (V4 layout, compress ratios
4 and 128, c4 indexer) on CPU, a real ReqToTokenPool and a real ForwardBatch.

The GPU kernels that store latents / index keys cannot run here; `_store` writes token rows with
the byte addressing of the pool's KVLayout (data rows, then the page's scale rows) at every slot a
row's loc maps to, a superset of what the compressors write.
"""
import logging
import weakref

import pytest
import torch

P = 256
PAGES = 16


@pytest.fixture(scope="module")
def pool():
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=P))
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool

    return DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=PAGES * P, c4_size=PAGES * P // 4, c128_size=PAGES * P // 128,
        c4_state_pool_size=4, c128_state_pool_size=4, page_size=P, swa_page_size=P,
        dtype=torch.float8_e4m3fn, c4_state_dtype=torch.float32, c128_state_dtype=torch.float32,
        qk_nope_head_dim=448, qk_rope_head_dim=64, indexer_head_dim=128, layer_num=4,
        device="cpu", enable_memory_saver=False, compression_ratios=[0, 4, 128, 4],
        full_size=PAGES * P)


def _buffers(pool):
    """(ratio, pool page, 2-D page-row buffer) of every latent and index-key buffer."""
    out = [(r, kv.page_size, b.view(torch.uint8).view(b.shape[0], -1))
           for r, kv in pool.kv_pools.items() for b in kv.kv_buffer]
    out += [(r, ix.page_size, b) for r, ix in pool.index_pools.items()
            for b in ix.contiguous_page_row_buffers()]
    return out


def _randomize(pool, seed):
    g = torch.Generator().manual_seed(seed)
    for _, _, buf in _buffers(pool):
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))
    for buf in pool.swa_kv_pool.kv_buffer:
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=g))


def _loc(pages):
    return torch.cat([torch.arange(p * P, (p + 1) * P) for p in pages])


def _store(pool, loc, seed):
    """Write a fresh token row at slot loc // ratio of every latent / index-key buffer."""
    g = torch.Generator().manual_seed(seed)
    for ratio, kv in pool.kv_pools.items():
        layout, ps = kv.kv_layout, kv.page_size
        data_stride, scale_base, scale_stride = layout.row_addressing(ps)
        for b in kv.kv_buffer:
            buf = b.view(torch.uint8).view(b.shape[0], -1)
            for slot in torch.unique(loc // ratio).tolist():
                page, i = divmod(slot, ps)
                buf[page, i * data_stride:i * data_stride + layout.data_bytes] = torch.randint(
                    0, 256, (layout.data_bytes,), dtype=torch.uint8, generator=g)
                at = scale_base + i * scale_stride
                buf[page, at:at + layout.scale_bytes] = torch.randint(
                    0, 256, (layout.scale_bytes,), dtype=torch.uint8, generator=g)
    for ratio, ix in pool.index_pools.items():
        ps = ix.page_size
        for buf in ix.contiguous_page_row_buffers():
            for slot in torch.unique(loc // ratio).tolist():
                page, i = divmod(slot, ps)
                buf[page, i * 128:(i + 1) * 128] = torch.randint(0, 256, (128,), dtype=torch.uint8,
                                                                 generator=g)
                buf[page, ps * 128 + i * 4:ps * 128 + (i + 1) * 4] = torch.randint(
                    0, 256, (4,), dtype=torch.uint8, generator=g)


def _pages_equal(buf, ps, ratio, a, b):
    k = P // ratio // ps
    ia = torch.cat([torch.arange(p * k, (p + 1) * k) for p in a])
    ib = torch.cat([torch.arange(p * k, (p + 1) * k) for p in b])
    return bool((buf[ia] == buf[ib]).all())


def test_copy_puts_exactly_the_resident_bytes_in_the_replay_rows(pool):
    from adapter.swa_cone_copy import copy_resident

    _randomize(pool, 1)
    before = [buf.clone() for _, _, buf in _buffers(pool)]
    swa_before = [b.clone() for b in pool.swa_kv_pool.kv_buffer]
    src, dst = [3, 4], [9, 10]
    assert not all(_pages_equal(buf, ps, r, src, dst) for r, ps, buf in _buffers(pool))
    report = copy_resident(pool, _loc(src), _loc(dst), page_size=P)
    total = 0
    for (ratio, ps, buf), old in zip(_buffers(pool), before):
        k = P // ratio // ps
        moved = torch.cat([torch.arange(p * k, (p + 1) * k) for p in dst])
        assert _pages_equal(buf, ps, ratio, src, dst), ratio
        keep = torch.ones(buf.shape[0], dtype=torch.bool)
        keep[moved] = False
        assert torch.equal(buf[keep], old[keep])              # nothing else changed
        total += moved.numel() * buf.shape[1]
    assert (report.full_pages, report.buffers, report.bytes) == (2, len(before), total)
    assert all(torch.equal(a, b) for a, b in zip(pool.swa_kv_pool.kv_buffer, swa_before))


def test_copy_refuses_partial_or_overlapping_pages(pool):
    from adapter.swa_cone_copy import copy_resident

    with pytest.raises(ValueError):
        copy_resident(pool, _loc([3])[:200], _loc([9])[:200], page_size=P)
    with pytest.raises(ValueError):
        copy_resident(pool, _loc([3, 4]), _loc([4, 5]), page_size=P)
    with pytest.raises(ValueError):
        copy_resident(pool, _loc([3]).flip(0), _loc([9]), page_size=P)


def _batch(r2t, *, s, F, tail, other):
    """Request A: prefix [0, s) resident, first pass [s, F + tail) on fresh pages; request B: a
    plain 0-prefix extend of `other` tokens."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    a_row = torch.cat([_loc([1, 2]), _loc([9, 10]), _loc([11])[:tail]])  # [0,s) | [s,F) | [F,..)
    b_row = _loc([12, 13])[:other]
    r2t[0, :a_row.numel()] = a_row.to(r2t.dtype)
    r2t[1, :b_row.numel()] = b_row.to(r2t.dtype)
    out = torch.cat([a_row[s:], b_row])
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=2,
                      input_ids=torch.zeros(out.numel(), dtype=torch.int64),
                      req_pool_indices=torch.tensor([0, 1]),
                      seq_lens=torch.tensor([F + tail, other]), out_cache_loc=out,
                      seq_lens_sum=F + tail + other)
    fb.rids = ["A", "B"]
    fb.extend_prefix_lens_cpu = [s, 0]
    fb.extend_seq_lens_cpu = [F + tail - s, other]
    fb.req_pool_indices_cpu = torch.tensor([0, 1])
    return fb


def _cone_with_plan(s, F, test=True, **switches):
    """A Cone (N = F - s; switches: no_floor / no_copy) holding one plan, request "A"."""
    from adapter.swa_cone import Cone, Plan

    cone = Cone(F - s, test=test, **switches)
    cone.plans["A"] = Plan(rid="A", F=F, s=s, L=F + 100, src_loc=_loc([3, 4]))
    return cone


def test_replay_rows_copy_mask_and_floor(pool, caplog):
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.mem_cache.dsv41_request_window import window_layout

    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 2)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _cone_with_plan(s, F)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    copies = [r.getMessage() for r in caplog.records if " copy " in r.getMessage()]
    assert len(applied) == 1 and len(copies) == 1 and "request=A rows=[512,1024)" in copies[0]
    assert "A" not in cone.plans                              # one copy per replay
    for ratio, ps, buf in _buffers(pool):
        assert _pages_equal(buf, ps, ratio, [3, 4], [9, 10])
    n_a = F + tail - s
    keep = torch.cat([torch.arange(F - s, n_a), torch.arange(n_a, n_a + other)])
    assert torch.equal(fb.encoder_swa_compress_rows, keep)

    # The engine's own compressor-loc rule: replay rows write the padding slot.
    loc = DeepseekV4AttnBackend._compressor_out_loc(fb)
    assert bool((loc[:F - s] == 0).all()) and torch.equal(loc[F - s:], fb.out_cache_loc[F - s:])
    snap = [buf.clone() for _, _, buf in _buffers(pool)]
    _store(pool, loc, seed=3)
    for (ratio, ps, buf), old in zip(_buffers(pool), snap):
        assert _pages_equal(buf, ps, ratio, [3, 4], [9, 10]), "replay rows were overwritten"
        k = P // ratio // ps
        assert not torch.equal(buf[:k], old[:k])              # the padding page took the writes
        assert not torch.equal(buf[11 * k:12 * k], old[11 * k:12 * k])   # rows >= F wrote
    # Unmasked, the same writes would land on the replay rows (the check above can fail).
    _store(pool, fb.out_cache_loc, seed=4)
    assert not all(_pages_equal(buf, ps, r, [3, 4], [9, 10]) for r, ps, buf in _buffers(pool))

    # Window floored at s: rows of A never see a position below s; B is unchanged.
    floor = fb.encoder_swa_row_floor
    assert torch.equal(floor, torch.tensor([s] * n_a + [0] * other))
    req = torch.tensor([0] * n_a + [1] * other)
    pos = torch.cat([torch.arange(s, F + tail), torch.arange(0, other)])
    lay = window_layout(req, pos, zero_row=4 * P, window=128, capacity=P, floor=floor)
    want = torch.minimum(pos - floor + 1, torch.tensor(128))
    assert torch.equal(lay.lengths.long(), want)
    plain = window_layout(req, pos, zero_row=4 * P, window=128, capacity=P)
    assert not torch.equal(plain.lengths, lay.lengths)         # the floor is what bounds A

    # Paged SWA path: the same floor reaches init_forward_metadata_prefill as swa_replay_start.
    seen = {}

    def original(backend, **kwargs):
        seen.update(kwargs)

    class _Pool:
        request_window = None

    class _Backend:
        token_to_kv_pool = _Pool()

    cone.init_prefill_metadata(original, _Backend(), forward_batch=fb,
                               out_cache_loc=fb.out_cache_loc, swa_replay_start=None)
    assert torch.equal(seen["swa_replay_start"], floor)


def test_batch_without_a_plan_is_untouched(pool):
    s, F = 512, 1024
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=100, other=300)
    fb.extend_prefix_lens_cpu = [s + 256, 0]                  # not the planned first pass
    cone = _cone_with_plan(s, F)
    assert cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P) == []
    assert fb.encoder_swa_compress_rows is None and fb.encoder_swa_row_floor is None
    assert "A" in cone.plans


def test_cone_test_switch_checks_the_copy(pool):
    from adapter.swa_cone import _verify_copy
    from adapter.swa_cone_copy import copy_resident

    _randomize(pool, 5)
    copy_resident(pool, _loc([3, 4]), _loc([9, 10]), page_size=P)
    _verify_copy(pool, _loc([3, 4]), _loc([9, 10]), P)
    pool.index_pools[4].contiguous_page_row_buffers()[0][9, 0] ^= 0xFF
    with pytest.raises(AssertionError):
        _verify_copy(pool, _loc([3, 4]), _loc([9, 10]), P)


def test_no_floor_test_switch_copies_and_masks_but_sets_no_floor(pool, caplog):
    """DSV41_SWA_CONE_TEST_NO_FLOOR (test only, the negative control of the floor): the same copy
    and write mask, no window floor on either path, and a loud line per replay."""
    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 6)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _cone_with_plan(s, F, no_floor=True)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    lines = [r.getMessage() for r in caplog.records]
    assert len(applied) == 1 and [ln for ln in lines if " copy request=A " in ln]
    removed = [ln for ln in lines if "TEST ONLY window floor REMOVED request=A rows=[512,1024)" in ln]
    assert len(removed) == 1 and "DSV41_SWA_CONE_TEST_NO_FLOOR=1" in removed[0]
    for ratio, ps, buf in _buffers(pool):
        assert _pages_equal(buf, ps, ratio, [3, 4], [9, 10])           # copied as usual
    assert fb.encoder_swa_compress_rows is not None                    # masked as usual
    assert fb.encoder_swa_row_floor is None                            # ... but not floored
    seen = {}

    class _Pool:
        request_window = None

    class _Backend:
        token_to_kv_pool = _Pool()

    cone.init_prefill_metadata(lambda backend, **kw: seen.update(kw), _Backend(), forward_batch=fb,
                               out_cache_loc=fb.out_cache_loc, swa_replay_start=None)
    assert seen["swa_replay_start"] is None


def test_negative_control_switches_are_off_by_default_and_named_at_install(monkeypatch):
    from adapter import keys, swa_cone

    monkeypatch.setattr(swa_cone, "_cone", swa_cone._cone)     # install() sets it: restored after

    for name in (swa_cone.NO_FLOOR_KEY, swa_cone.NO_COPY_KEY):
        key = keys.KEY_BY_NAME[name]
        assert key.test_only and key.adapter == "swa_cone" and key.default == 0 and not key.enables
    plain = swa_cone.Cone(512, test=False)
    assert plain.no_floor is False and plain.no_copy is False

    class Ctx:
        def __init__(self, env):
            self.settings = keys.parse_env(env)
            self.rows = []

        def value(self, name):
            return self.settings.get(name)

        def around(self, qualname, hook):
            self.rows.append(qualname)

    line = swa_cone.install(Ctx({"DSV41_SWA_CONE_REPLAY": "1"}))
    assert "TEST ONLY" not in line and not swa_cone.state().no_floor
    loud = swa_cone.install(Ctx({"DSV41_SWA_CONE_REPLAY": "1", swa_cone.NO_FLOOR_KEY: "1"}))
    assert "TEST ONLY, NEGATIVE CONTROL: DSV41_SWA_CONE_TEST_NO_FLOOR=1" in loud
    assert swa_cone.state().no_floor and not swa_cone.state().no_copy
    loud = swa_cone.install(Ctx({"DSV41_SWA_CONE_REPLAY": "1", swa_cone.NO_COPY_KEY: "1"}))
    assert "TEST ONLY, NEGATIVE CONTROL: DSV41_SWA_CONE_TEST_NO_COPY=1" in loud
    assert swa_cone.state().no_copy and not swa_cone.state().no_floor


def test_no_copy_test_switch_masks_and_floors_but_copies_nothing(pool, caplog):
    """DSV41_SWA_CONE_TEST_NO_COPY (test only, the negative control of the copy): the same mask and
    floor, the replay rows' pages keep their stale bytes, no copy line, a loud line instead."""
    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 7)
    before = [buf.clone() for _, _, buf in _buffers(pool)]
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _cone_with_plan(s, F, no_copy=True)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    lines = [r.getMessage() for r in caplog.records]
    assert applied == [] and not [ln for ln in lines if " copy request=" in ln]
    skipped = [ln for ln in lines if "TEST ONLY copy SKIPPED request=A rows=[512,1024)" in ln]
    assert len(skipped) == 1 and "DSV41_SWA_CONE_TEST_NO_COPY=1" in skipped[0]
    assert not [ln for ln in lines if "abort" in ln]                   # served, not failed
    for (_, _, buf), old in zip(_buffers(pool), before):
        assert torch.equal(buf, old)                                    # nothing copied
    n_a = F + tail - s
    keep = torch.cat([torch.arange(F - s, n_a), torch.arange(n_a, n_a + other)])
    assert torch.equal(fb.encoder_swa_compress_rows, keep)              # masked as usual
    assert torch.equal(fb.encoder_swa_row_floor, torch.tensor([s] * n_a + [0] * other))


# ---- two replays in one batch, and the batch's edges (found by bench/mutation.py) ------------

def _two_plans(s, F, tail, *, a_F=None, **switches):
    """Requests A (replay [s, a_F or F)) and B (replay [0, 256): B's first pass starts at 0)."""
    from adapter.swa_cone import Cone, Plan

    cone = Cone(F - s, test=False, **switches)
    cone.plans["A"] = Plan(rid="A", F=a_F or F, s=s, L=F + tail, src_loc=_loc([3, 4]))
    cone.plans["B"] = Plan(rid="B", F=256, s=0, L=300, src_loc=_loc([5]))
    return cone


def test_a_short_first_pass_fails_its_replay_and_the_next_one_still_copies(pool, caplog):
    from adapter import receipts

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 11)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    fb.req_pool_indices_cpu = None                  # the engine's batch may carry only the device copy
    cone = _two_plans(s, F, tail, a_F=F + tail + 256)   # A's pass ends before its F
    applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert [plan.rid for plan, _ in applied] == ["B"]
    counts = receipts.counters["swa_cone"]
    assert counts["copies"] == 1 and counts["replays_aborted"] == 1
    assert counts["fallback:forward pass shorter than the planned replay: request failed (HTTP 503), "
                  "its KV kept out of the tree"] == 1
    for ratio, ps, buf in _buffers(pool):
        assert _pages_equal(buf, ps, ratio, [5], [12])          # B's replay rows got page 5


def test_a_first_pass_ending_exactly_at_f_is_a_replay(pool):
    s, F, other = 512, 1024, 300
    _randomize(pool, 12)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=0, other=other)             # A's pass is [s, F) exactly
    applied = _cone_with_plan(s, F, test=False).apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert len(applied) == 1
    for ratio, ps, buf in _buffers(pool):
        assert _pages_equal(buf, ps, ratio, [3, 4], [9, 10])


def test_no_copy_switch_says_so_for_every_replay(pool, caplog):
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _two_plans(s, F, tail, no_copy=True)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        assert cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P) == []
    skipped = [r.getMessage() for r in caplog.records if "TEST ONLY copy SKIPPED" in r.getMessage()]
    assert [m.split("[dsv41] swa_cone ", 1)[1] for m in skipped] == [
        f"TEST ONLY copy SKIPPED request={rid} rows=[{a},{b}): DSV41_SWA_CONE_TEST_NO_COPY=1, the "
        "replay rows' pages keep stale latents / index keys; this output is not cone's"
        for rid, a, b in (("A", s, F), ("B", 0, 256))]



def test_no_mask_switch_copies_sets_no_mask_and_says_so_for_every_replay(pool, caplog):
    """DSV41_SWA_CONE_TEST_NO_MASK (test only, the negative control of the write mask): both
    replays copied as usual, no compress-row mask on the batch (the replay rows write their own
    latents / index keys over the copies), one loud line per replay naming the switch."""
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _two_plans(s, F, tail, no_mask=True)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert [plan.rid for plan, _ in applied] == ["A", "B"]             # copied as usual
    assert fb.encoder_swa_compress_rows is None                         # no write mask
    removed = [m for m in _lines(caplog) if m.startswith("TEST ONLY write mask")]
    assert removed == [
        f"TEST ONLY write mask REMOVED request={rid} rows=[{a},{b}): DSV41_SWA_CONE_TEST_NO_MASK=1, "
        "the replay rows write their own latents / index keys over the copied ones; this output is "
        "not cone's" for rid, a, b in (("A", s, F), ("B", 0, 256))]

def _lines(caplog):
    return [r.getMessage().split("[dsv41] swa_cone ", 1)[-1] for r in caplog.records]


def test_both_replays_copy_and_a_failed_copy_does_not_stop_the_next(pool, caplog, monkeypatch):
    from adapter import receipts, swa_cone

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 13)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _two_plans(s, F, tail)
    cone.test = True                                  # the copy self-check on (DSV41_SWA_CONE_TEST)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert [p.rid for p, _ in applied] == ["A", "B"] and receipts.counters["swa_cone"]["copies"] == 2
    copies = [ln for ln in _lines(caplog) if ln.startswith("copy request=")]
    assert [ln.split(" buffers=")[0] for ln in copies] == ["copy request=A rows=[512,1024) pages=2",
                                                          "copy request=B rows=[0,256) pages=1"]
    # A's source overlaps its destination (the copy's own page check refuses): B still copies
    receipts.forget("swa_cone")
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _two_plans(s, F, tail)
    cone.plans["A"].src_loc = _loc([9, 10])
    applied = cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert [p.rid for p, _ in applied] == ["B"] and receipts.counters["swa_cone"]["copies"] == 1


@pytest.mark.parametrize("engine_has", ["compress rows", "replay fold"])
def test_an_engine_encoder_replay_keeps_its_compress_rows(pool, engine_has):
    from adapter import receipts

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    mine = torch.arange(3)
    if engine_has == "compress rows":
        fb.encoder_swa_compress_rows = mine
    else:
        fb.encoder_swa_replay = True
    _cone_with_plan(s, F, test=False).apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert (fb.encoder_swa_compress_rows is mine) if engine_has == "compress rows" else \
        (fb.encoder_swa_compress_rows is None)
    assert receipts.counters["swa_cone"]["fallback:engine encoder-replay fold owns the compress rows; "
                                         "replay rows keep their own latent writes"] == 1
    assert fb.encoder_swa_row_floor is not None                     # floored all the same


def test_no_floor_switch_line_in_full(pool, caplog):
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        _cone_with_plan(s, F, test=False, no_floor=True).apply(fb, pool=pool, req_to_token=r2t, page_size=P)
    assert [ln for ln in _lines(caplog) if ln.startswith("TEST ONLY window floor")] == [
        "TEST ONLY window floor REMOVED request=A rows=[512,1024): DSV41_SWA_CONE_TEST_NO_FLOOR=1, "
        "replay rows read window slots below s=512 (evicted, the padding slot); this output is not "
        "cone's"]


def test_a_failed_mask_or_floor_fails_every_replay_of_the_batch(pool, monkeypatch):
    from adapter import receipts
    from adapter import swa_cone_copy as cc
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    cone = _two_plans(s, F, tail)
    reqs = {rid: Req(rid=rid, origin_input_text="", origin_input_ids=[1, 2, 3],
                     sampling_params=SamplingParams(temperature=0, max_new_tokens=1)) for rid in "AB"}
    for rid, plan in cone.plans.items():
        plan.req = weakref.ref(reqs[rid])
    monkeypatch.setattr(cc, "row_floor", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    assert cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P) == []
    for rid in "AB":
        assert "replay mask/floor failed (RuntimeError)" in reqs[rid].discard_output_reason.message
    assert receipts.counters["swa_cone"]["replays_aborted"] == 2


def test_a_batch_without_prefix_lengths_fails_its_replays(pool):
    from adapter import receipts
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    fb.extend_prefix_lens_cpu = None
    cone = _cone_with_plan(s, F, test=False)
    req = Req(rid="A", origin_input_text="", origin_input_ids=[1, 2, 3],
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    cone.plans["A"].req = weakref.ref(req)
    assert cone.apply(fb, pool=pool, req_to_token=r2t, page_size=P) == [] and not cone.plans
    assert req.discard_output_reason.message.startswith(
        "swa_cone: the replay of tokens [512, 1024) could not be prepared (batch without readable "
        "prefix lengths (TypeError))")
    assert fb.encoder_swa_row_floor is None                          # nothing was prepared
    # a batch that names no requests (no rids): nothing to do
    nameless = _batch(r2t, s=s, F=F, tail=tail, other=other)
    del nameless.rids
    assert _cone_with_plan(s, F, test=False).apply(nameless, pool=pool, req_to_token=r2t, page_size=P) == []


def test_the_copy_self_check_fails_a_copy_that_did_not_land(pool, monkeypatch):
    """DSV41_SWA_CONE_TEST re-reads each copy: a copy that moved nothing fails its replay."""
    from adapter import receipts
    from adapter import swa_cone_copy as cc

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    _randomize(pool, 14)
    r2t = torch.zeros(4, PAGES * P, dtype=torch.int32)
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    import types

    monkeypatch.setattr(cc, "copy_resident", lambda *a, **k: types.SimpleNamespace(
        full_pages=2, buffers=0, bytes=0))              # reports a copy, moves nothing
    assert _cone_with_plan(s, F, test=True).apply(fb, pool=pool, req_to_token=r2t, page_size=P) == []
    counts = receipts.counters["swa_cone"]
    assert counts["copies"] == 0 and counts["replays_aborted"] == 1


@pytest.mark.parametrize("host, swa_host", [(256, 0), (0, 256)])
def test_a_host_hit_keeps_the_stock_match(host, swa_host):
    """A match served partly from the HiCache host pool: no candidate (the copy reads device KV)."""
    import types

    from adapter import receipts, swa_cone
    from adapter.cpu import cpu_engine

    receipts.forget("swa_cone")
    cpu = cpu_engine.build_swa_cache(full_tokens=64 * P, swa_tokens=16 * P)
    result = types.SimpleNamespace(swa_branching_seqlen=8 * P, device_prefix_len=P,
                                   host_hit_length=host, swa_host_hit_length=swa_host)
    assert swa_cone.Cone(1024, test=False).candidate(cpu.cache, None, result) is None
    assert receipts.counters["swa_cone"]["fallback:host (HiCache) hit on the match; stock match "
                                         "kept"] == 1
