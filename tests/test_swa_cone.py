"""Cone replay, match side: the real UnifiedRadixCache (FULL + SWA, page 256, window 128) and the
real PrefillAdder on CPU, with swa_cone installed through the production installer.

Scenario: a document is prefilled in chunks (checkpointed like the scheduler does), then distinct
prompts push its SWA window out of the pool while its full KV stays resident; then the document
plus new tokens arrives.
"""
import logging

import pytest
import torch

from adapter import receipts

N = 1024            # DSV41_SWA_CONE_TOKENS for these tests (page aligned)
CHUNK = 2048
DOC = 6000
TAIL = 700


def _cone_env(tokens=N):
    return {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(tokens)}


def _setup(backend, *, evict=True, chunk=CHUNK, attention_backend="dsv4", server_args=None,
           **cache_params):
    from adapter.tools.sims.swa_cone import Driver, build

    cpu = build(60_000, 4096, backend, attention_backend=attention_backend, server_args=server_args,
                **cache_params)
    drv = Driver(cpu, chunk=chunk)
    doc = list(range(1, DOC + 1))
    drv.prefill(doc, output_tokens=[7] * 40)
    if evict:
        for i in range(12):       # 12 x 1040 tokens of SWA through a 4096-slot SWA pool
            start = 1_000_000 + 1024 * i
            drv.prefill(list(range(start, start + 1024)), output_tokens=[5] * 16)
    return cpu, drv, doc + list(range(900_000, 900_000 + TAIL))


def _arrive(drv, tokens):
    req = drv._req(tokens)
    req.init_next_round_input(drv.cache)
    return req


def _full_resident_end(cpu, tokens):
    """Page-aligned resident full KV of `tokens` (the engine's read-only FULL-device match)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from array import array

    matched, _, _ = cpu.cache.tree_core.match_full_device_prefix(RadixKey(array("q", tokens[:-1])))
    return matched // 256 * 256


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_lost_resume_point_plans_a_replay_of_n_tokens(install_adapters, caplog, backend):
    status = install_adapters(_cone_env())
    receipts.forget("swa_cone")
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail
    cpu, drv, prompt = _setup(backend)
    # earlier plans of this process: the counters add to them (the /metrics series are totals)
    receipts.counters["swa_cone"].update({"candidates": 3, "plans": 2, "replay_tokens": 7})
    req = _arrive(drv, prompt)
    stock_prefix = req.prefix_len                  # the stock match stands until admission
    F = _full_resident_end(cpu, prompt)
    assert F - stock_prefix > N, (F, stock_prefix)  # the resume point is lost, full KV resident
    adder = drv.adder()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list
    s = F - N
    assert req.prefix_len == s and req.kv.cache_protected_len == s
    assert req.extend_end >= F                       # the first pass covers the replay
    assert adder.log_hit_tokens == s
    # The request's tree lock sits on the node at F: [s, F) stays resident until the copy.
    root = drv.cache.root_node_handle(None)
    assert drv.cache.tree_core.collect_full_device_indices(req.lock.node, root).numel() >= F
    plans = [r.getMessage() for r in caplog.records if " plan " in r.getMessage()]
    assert len(plans) == 1
    assert plans[0].endswith(f"[dsv41] swa_cone plan request={req.rid} F={F} s={s} L={len(prompt)} "
                             f"replay={N} first_pass=[{s},{req.extend_end}) stock_prefix={stock_prefix}")
    counts = receipts.counters["swa_cone"]
    assert (counts["candidates"], counts["plans"], counts["replay_tokens"]) == (3 + 1, 2 + 1, 7 + N)
    # The prefix indices the forward reads are the resident full KV of [0, s).
    prefix = drv.cache.prefix_device_indices(req)
    assert prefix.numel() == s
    # The first pass re-fills the window: the next arrival is a plain prefix hit past F.
    from adapter import swa_cone
    plan = swa_cone.state().plans[req.rid]
    assert (plan.F, plan.s, plan.src_loc.numel()) == (F, s, N)
    assert plan.tree is drv.cache                   # whose TP groups agree on a failed replay
    assert plan.src_loc.dtype == torch.int64 and plan.src_loc.device.type == "cpu"
    if backend == "python":
        # the admission's lock (taken on the node at s) moved to the node at F: the node at s
        # is locked once (by the new lock's path), not twice
        from sglang.srt.mem_cache.unified_cache.components import BASE_COMPONENT_TYPE

        node_s = drv.cache.tree_core.node_by_id(req.last_node)
        assert req.lock.node != req.last_node
        assert node_s.component_data[BASE_COMPONENT_TYPE].lock_ref == 1
    drv._extend(req, req.extend_end)
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    if req.extend_end < len(prompt):
        checkpoint_kv_cache(req, drv.cache)
        a2 = drv.adder()
        a2.add_chunked_req(req)
        drv._extend(req, req.extend_end)
    from adapter.tools.sims.swa_cone import _finished
    req.finished_len = req.kv.kv_committed_len
    req.finished_reason = _finished()
    release_kv_cache(req, drv.cache, checkpoint=True)
    again = _arrive(drv, prompt + [3] * 300)
    assert again.prefix_len >= F
    drv.cache.sanity_check()


def test_stock_without_cone_re_prefills_the_whole_context(install_adapters):
    install_adapters({})
    cpu, drv, prompt = _setup("python")
    req = _arrive(drv, prompt)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.prefix_len < 512 and _full_resident_end(cpu, prompt) > 4096


def test_replay_not_covered_by_the_first_chunk_keeps_the_stock_match(install_adapters, caplog):
    install_adapters(_cone_env())
    receipts.forget("swa_cone")
    cpu, drv, prompt = _setup("python")
    drv.chunk = 512                                  # first pass can hold 512 < N rows
    req = _arrive(drv, prompt)
    stock_prefix, stock_node = req.prefix_len, req.last_node
    before = receipts.counters["swa_cone"]["plans"]
    adder = drv.adder()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list
    assert (req.prefix_len, req.last_node) == (stock_prefix, stock_node)
    assert req.extend_end == stock_prefix + 512
    assert receipts.counters["swa_cone"]["plans"] == before
    reason = "first pass does not cover the replay (chunk budget below N); stock match kept"
    assert receipts.counters["swa_cone"][f"fallback:{reason}"] >= 1
    assert any("fallback" in r.getMessage() and "does not cover" in r.getMessage()
               for r in caplog.records)
    assert not any(" plan " in r.getMessage() for r in caplog.records)


def test_intact_resume_point_is_a_stock_prefix_hit(install_adapters, caplog):
    install_adapters(_cone_env())
    receipts.forget("swa_cone")
    cpu, drv, prompt = _setup("python", evict=False)
    req = _arrive(drv, prompt)
    assert req.prefix_len >= DOC // 256 * 256 - 256    # the window is still there
    assert getattr(req, "_dsv41_cone_candidate", None) is None
    hit = req.prefix_len
    plans = receipts.counters["swa_cone"]["plans"]
    adder = drv.adder()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        receipts.line("swa_cone", "probe: capture is on")     # what this capture would record
    assert req.prefix_len == hit and req in adder.can_run_list
    assert [r.getMessage() for r in caplog.records if "probe: capture is on" in r.getMessage()]
    assert not any(" plan " in r.getMessage() for r in caplog.records)
    assert receipts.counters["swa_cone"]["plans"] == plans
    assert not [k for k in receipts.counters["swa_cone"] if k.startswith("fallback:")]


def test_admission_refused_leaves_the_stock_match(install_adapters):
    """A request the adder cannot take this round keeps its stock match for the next round."""
    install_adapters(_cone_env())
    cpu, drv, prompt = _setup("python")
    req = _arrive(drv, prompt)
    stock = (req.prefix_len, req.last_node, req.kv.cache_protected_len)
    adder = drv.adder()
    adder.rem_chunk_tokens = 0                        # no chunk budget left this round
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req not in adder.can_run_list
    assert (req.prefix_len, req.last_node, req.kv.cache_protected_len) == stock


@pytest.mark.parametrize("attention_backend", ["torch_native", "flashinfer"])
def test_no_plan_where_the_dsv4_forward_side_cannot_run(install_adapters, caplog, attention_backend):
    """Issue 16: on another attention backend nothing would copy, mask and floor the replay rows,
    so a lost resume point keeps the stock match, with one fallback line naming the backend."""
    receipts.forget("swa_cone")
    status = install_adapters(_cone_env())
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail
    cpu, drv, prompt = _setup("python", attention_backend=attention_backend)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        req = _arrive(drv, prompt)
        stock_prefix = req.prefix_len
        assert _full_resident_end(cpu, prompt) - stock_prefix > N     # the resume point is lost
        adder = drv.adder()
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req.prefix_len == stock_prefix
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if " plan " in m]
    fallbacks = [m for m in messages if "swa_cone fallback" in m]
    assert len(fallbacks) == 1 and fallbacks[0].endswith(
        f"swa_cone fallback: prefill attention served by backend {attention_backend!r}, not "
        "DeepseekV4AttnBackend: nothing would copy, mask and floor the replay rows; stock match "
        "kept (logged once)")


def test_no_plan_beside_the_engines_encoder_swa_bounded_replay(install_adapters, caplog):
    """With the engine's encoder SWA bounded replay in effect (the real ServerArgs field, published
    as the engine publishes it) the cache keeps no SWA window and the engine folds its own replay
    rows into the compress rows cone masks, so a lost resume point keeps the stock match: one
    fallback line naming the flag, counted per lost resume point."""
    flag = "--enable-encoder-swa-bounded-replay"
    receipts.forget("swa_cone")
    status = install_adapters(_cone_env())
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail
    field = flag.lstrip("-").replace("-", "_")
    cpu, drv, prompt = _setup("python", server_args={field: True})
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        _arrive(drv, prompt)                                      # a first lost resume point
        req = _arrive(drv, prompt)                                # and a second
        stock = (req.prefix_len, req.last_node, req.kv.cache_protected_len)
        assert _full_resident_end(cpu, prompt) - stock[0] > N     # the resume point is lost
        adder = drv.adder()
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list                              # admitted, as stock admits it
    assert (req.prefix_len, req.last_node, req.kv.cache_protected_len) == stock
    assert not swa_cone_state_plans()
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if " plan " in m]
    fallbacks = [m for m in messages if "swa_cone fallback" in m]
    assert len(fallbacks) == 1 and fallbacks[0].endswith(
        f"swa_cone fallback: the engine's {flag} is on: it caches no SWA window and folds its own "
        "replay rows into the compress rows cone masks (docs/swa_cone.md); stock match kept "
        "(logged once)"), fallbacks
    counted = {k: v for k, v in receipts.counters["swa_cone"].items() if flag in k}
    assert list(counted.values()) == [2]
    assert receipts.counters["swa_cone"]["candidates"] == 0


@pytest.mark.parametrize("chunk,cut", [(CHUNK, True), (N, False)])
def test_beside_the_engines_decoder_swa_bounded_replay_the_first_pass_ends_at_F(
        install_adapters, caplog, chunk, cut):
    """Issue 48: the engine resolves --enable-decoder-swa-bounded-replay on for DeepSeek-V4.1 on
    CUDA (the cluster's line). Cone plans beside it (the decline is gone), and a first pass that is
    not the request's last ends exactly at F, so the later passes (and the late layers' 128-row
    tail at each pass's end) fall where a prefix hit at F puts them. With N equal to the chunk
    (production: 8192 and 8192) nothing is cut."""
    receipts.forget("swa_cone")
    install_adapters(_cone_env())
    cpu, drv, prompt = _setup("python", chunk=chunk,
                              server_args={"enable_decoder_swa_bounded_replay": True},
                              decoder_swa_bounded_replay=True)
    assert cpu.cache.swa_reprefill_tail_tokens(None) == 128      # the engine's match limit is on
    req = _arrive(drv, prompt)
    F = _full_resident_end(cpu, prompt)
    assert F - req.prefix_len > N
    adder = drv.adder()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list
    assert receipts.counters["swa_cone"]["plans"] == 1
    assert req.prefix_len == F - N
    assert req.extend_end == F                       # the replay alone: the pass ends at F
    assert adder.new_chunked_req is req              # the engine chunks the rest from F on
    assert receipts.counters["swa_cone"]["first_pass_cut_at_F"] == (1 if cut else 0)
    assert not [r for r in caplog.records if "swa_cone fallback" in r.getMessage()]


def test_beside_the_decoder_replay_a_single_pass_is_left_whole(install_adapters):
    """A first pass that is the request's only one ends at L, as a prefix hit at F's does: it is
    not cut (the cut would only add a pass)."""
    receipts.forget("swa_cone")
    install_adapters(_cone_env())
    cpu, drv, prompt = _setup("python", chunk=8192,
                              server_args={"enable_decoder_swa_bounded_replay": True},
                              decoder_swa_bounded_replay=True)
    req = _arrive(drv, prompt)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert receipts.counters["swa_cone"]["plans"] == 1
    assert req.extend_end == len(prompt) and adder.new_chunked_req is None
    assert receipts.counters["swa_cone"]["first_pass_cut_at_F"] == 0


def swa_cone_state_plans():
    from adapter import swa_cone

    return dict(swa_cone.state().plans)


def test_plans_again_with_the_engines_bounded_replay_flags_off(install_adapters):
    """The same published ServerArgs with both flags explicitly off: cone plans (the decline reads
    the flags' values, not their presence)."""
    receipts.forget("swa_cone")
    install_adapters(_cone_env())
    cpu, drv, prompt = _setup("python", server_args={"enable_decoder_swa_bounded_replay": False,
                                                      "enable_encoder_swa_bounded_replay": False})
    req = _arrive(drv, prompt)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert receipts.counters["swa_cone"]["plans"] == 1
    assert req.prefix_len == _full_resident_end(cpu, prompt) - N


def test_n_reaching_below_the_stock_hit_keeps_the_stock_match(install_adapters, caplog):
    """N so large that s = F - N is not past the stock hit: nothing to gain, no candidate."""
    install_adapters(_cone_env(tokens=65536))
    receipts.forget("swa_cone")
    cpu, drv, prompt = _setup("python")
    req = _arrive(drv, prompt)
    assert getattr(req, "_dsv41_cone_candidate", None) is None
    counts = receipts.counters["swa_cone"]
    assert counts["candidates"] == 0
    assert counts["fallback:replay start F-N is not past the stock hit; stock match kept"] == 1


def _lost_resume_point(install_adapters):
    receipts.forget("swa_cone")
    status = install_adapters(_cone_env())
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail
    return _setup("python")


def _admit_without_plan(drv, prompt, caplog):
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        req = _arrive(drv, prompt)
        stock = (req.prefix_len, req.last_node)
        drv.adder().add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert (req.prefix_len, req.last_node) == stock and not swa_cone_state_plans()
    return [r.getMessage() for r in caplog.records if "swa_cone fallback" in r.getMessage()]


def test_a_re_match_that_finds_no_node_keeps_the_stock_match(install_adapters, caplog, monkeypatch):
    """Fault injected into the engine's tree walk on the key cut at s (the call cone makes, the
    one with a limit): no node reported. Cone keeps the stock match and says why."""
    cpu, drv, prompt = _lost_resume_point(install_adapters)
    real = drv.cache._match_tree

    def no_node(params):
        result = real(params)
        if params.key.limit is None:
            return result
        return result._replace(last_visited_node_id=None)     # the engine's MatchResult tuple

    monkeypatch.setattr(drv.cache, "_match_tree", no_node)
    fallbacks = _admit_without_plan(drv, prompt, caplog)
    assert len(fallbacks) == 1 and fallbacks[0].endswith(
        "swa_cone fallback: re-match on full KV found no node; stock match kept (logged once)"), fallbacks
    assert receipts.counters["swa_cone"]["candidates"] == 0


def test_a_re_match_that_ends_elsewhere_keeps_the_stock_match(install_adapters, caplog, monkeypatch):
    """Fault injected into cone's path length of the re-matched node: one page longer than s (the
    node at F still reaches F). Cone keeps the stock match and says why."""
    from adapter import swa_cone

    cpu, drv, prompt = _lost_resume_point(install_adapters)
    real = swa_cone._path_len
    monkeypatch.setattr(swa_cone, "_path_len", lambda cache, node, root: real(cache, node, root) + 256)
    fallbacks = _admit_without_plan(drv, prompt, caplog)
    assert len(fallbacks) == 1 and fallbacks[0].endswith(
        "swa_cone fallback: re-match on full KV did not end at s; stock match kept (logged once)"), fallbacks
    assert receipts.counters["swa_cone"]["candidates"] == 0
