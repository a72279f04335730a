"""The stock SM12x decode route on CPU (adapter/cpu/dsv4/flash_mla.py): the engine's own
`_split_kv_pages_to_64` with its two Triton kernels stood in, and FlashInfer's
`_sparse_mla_sm120_paged_attention` stood in by the engine's torch sparse decode reorganised
(`flash_mla._sparse_decode`: each referenced cache row dequantised once, then gathered by index).

The split is checked against the rule the kernel source documents (sglang/kernels/ops/attention/
flash_mla_sm120.py: the footer-layout comment above `_PBS_SRC` -- a 256-token page is
[256 x 576 data][256 x 8 scales][pad], a 64-token page [64 x 576][64 x 8][pad to 37,440] -- and the
docstrings of `_page_mark_kernel` (every valid token marks its source page) and
`_page_split_kernel` (only marked pages are copied; the persistent buffer keeps the rest)),
written here per token, and against the real Triton kernels run under Triton's interpreter: byte
copies, compared bit for bit. The stand-in's decode equals the engine's `_sm120_sparse_decode_fwd`
on the original 256-token view (output and LSE; decode and multi-chunk prefill sizes; with and
without the extra compressed cache, top-k lengths and the sink; -1 indices included), called
directly and through the whole stock route (split, then the stand-in), within the tolerance of a
summation order (`assert_decode_close`): the stand-in runs the engine's einsums CHUNK query tokens
at a time, the engine over the whole call, so the two are float32 sums of different shapes, which
another machine's BLAS may order differently (on this one they are bit-equal). Calls that repeat
one computation are compared bit for bit."""
import json
import math
import sys

import pytest
import torch

from adapter.cpu.dsv4 import flash_mla
from conftest import run_python

P, S, SP, SS = 256, 149_760, 64, 37_440
SENTINEL = 0xAB


def assert_decode_close(out, want, lse=None, want_lse=None):
    """The stand-in's decode against the engine's, computed with other shapes (module docstring).

    Output (bf16): a float32 sum of <= 192 products in another order moves by a few float32 ulps
    (~1e-5 of the largest term), so after the cast to bf16 it is the same value or the adjacent
    one: rtol = 2**-7 (one bf16 step relative to the value), atol = 1e-4 x the largest |output|
    for results near zero (their float32 error scales with the terms, not with the result).
    LSE (float32): a log of the same sum: within 1e-5 absolute and relative. A wrong row, mask,
    scale or sink moves either by orders of magnitude more."""
    assert out.dtype == want.dtype and out.shape == want.shape
    scale = float(want.float().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-4 * scale)
    if lse is not None:
        assert lse.shape == want_lse.shape
        torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@pytest.fixture
def engine(monkeypatch):
    """The engine module with the kernels and FlashInfer's module stood in, as the CPU server
    arms them; its persistent split buffers are this test's own (restored after)."""
    from sglang.kernels.ops.attention import flash_mla_sm120 as m
    from sglang.srt.runtime_context import get_resources

    monkeypatch.setattr(m, "_page_mark_kernel", flash_mla.page_mark_kernel)
    monkeypatch.setattr(m, "_page_split_kernel", flash_mla.page_split_kernel)
    monkeypatch.setitem(sys.modules, flash_mla.FLASHINFER_MODULE, flash_mla.flashinfer_module())
    buffers = get_resources().buffers
    saved = {k: buffers.pop(k) for k in list(buffers) if k.startswith("flash_mla_sm120_")}
    monkeypatch.setattr(flash_mla, "_logged", set())
    yield m
    for k in [k for k in buffers if k.startswith("flash_mla_sm120_")]:
        del buffers[k]
    buffers.update(saved)


def _pool(g, pages, tokens=P, stride=S):
    """Random page bytes: finite fp8 nope, bf16 rope, scale exponents near 1 (decodable)."""
    raw = torch.randint(0, 0x7F, (pages * stride,), dtype=torch.uint8, generator=g)
    view = raw.view(pages, stride)
    rope = (torch.randn(pages, tokens, 64, generator=g)).to(torch.bfloat16).view(torch.uint8)
    view[:, :tokens * 576].view(pages, tokens, 576)[:, :, 448:] = rope.view(pages, tokens, 128)
    view[:, tokens * 576:tokens * 584] = torch.randint(120, 134, (pages, tokens * 8), dtype=torch.uint8,
                                                       generator=g)
    return raw


def _view4(raw, tokens=P, stride=S):
    return raw.as_strided((raw.numel() // stride, tokens, 1, 584), (stride, 584, 584, 1))


def _seed_buffer(pages):
    """The engine's persistent split buffer, pre-filled with a sentinel (it is reused, not
    reallocated, while large enough)."""
    from sglang.srt.runtime_context import get_resources

    buf = torch.full((pages * 4, SS), SENTINEL, dtype=torch.uint8)
    get_resources().buffers["flash_mla_sm120_split:cpu"] = buf
    return buf


def _rule_check(raw, buf, touched, pages):
    """The documented mapping, per token: token r of source page p -> destination page
    p * 4 + r // 64, row r % 64; data at row * 576, scales at 64 * 576 + row * 8."""
    src = raw.view(pages, S)
    for p in touched:
        for r in range(P):
            d, row = p * 4 + r // 64, r % 64
            assert torch.equal(buf[d, row * 576:(row + 1) * 576], src[p, r * 576:(r + 1) * 576]), (p, r)
            assert torch.equal(buf[d, 64 * 576 + row * 8:64 * 576 + (row + 1) * 8],
                               src[p, P * 576 + r * 8:P * 576 + (r + 1) * 8]), (p, r)


def test_split_follows_the_kernels_documented_rule(engine):
    g = torch.Generator().manual_seed(0)
    pages = 6
    raw = _pool(g, pages)
    buf = _seed_buffer(pages)
    idx = torch.full((3, 128), -1, dtype=torch.int32)
    idx[0, :40] = torch.arange(1 * P, 1 * P + 40)                    # page 1
    idx[1, :5] = torch.tensor([4 * P, 4 * P + 63, 4 * P + 64, 4 * P + 255, 5 * P + 7])   # 4, 5
    out = engine._split_kv_pages_to_64(_view4(raw), P, touched_indices=idx)
    # the engine's own view of its persistent buffer
    assert tuple(out.shape) == (pages * 4, SP, 1, 584) and out.stride() == (SS, 584, 584, 1)
    assert out.data_ptr() == buf.data_ptr()
    _rule_check(raw, buf, [1, 4, 5], pages)
    untouched = [d for p in (0, 2, 3) for d in range(p * 4, p * 4 + 4)]
    assert bool((buf[untouched] == SENTINEL).all())                  # never written
    assert bool((buf[:, 64 * 584:] == SENTINEL).all())               # padding after the scales
    # next call: only page 0 is copied; page 1's earlier copy stays (stale, never re-read)
    raw2 = _pool(g, pages)
    idx2 = torch.full((1, 64), -1, dtype=torch.int32)
    idx2[0, 0] = 3
    engine._split_kv_pages_to_64(_view4(raw2), P, touched_indices=idx2)
    _rule_check(raw2, buf, [0], pages)
    _rule_check(raw, buf, [1, 4, 5], pages)
    assert bool((buf[8:16] == SENTINEL).all())
    # no indices: every page is copied (the kernel's HAS_MASK=False path)
    engine._split_kv_pages_to_64(_view4(raw2), P)
    _rule_check(raw2, buf, range(pages), pages)
    # grow-only: a larger pool gets a new buffer, a smaller one reuses it
    from sglang.srt.runtime_context import get_resources

    big = engine._split_kv_pages_to_64(_view4(_pool(g, pages + 2)), P, touched_indices=idx2)
    grown = get_resources().buffers["flash_mla_sm120_split:cpu"]
    assert grown.shape[0] == (pages + 2) * 4 and big.data_ptr() == grown.data_ptr() != buf.data_ptr()
    small = engine._split_kv_pages_to_64(_view4(raw2[:2 * S]), P, touched_indices=idx2)
    assert small.data_ptr() == grown.data_ptr() and small.shape[0] == 8


INTERPRETER_CHILD = r"""
import json, os, sys
assert os.environ.get("TRITON_INTERPRET") == "1"
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
import torch
from sglang.kernels.ops.attention import flash_mla_sm120 as m
from sglang.srt.runtime_context import get_resources
from adapter.cpu.dsv4 import flash_mla

P, S, SS = 256, 149760, 37440
g = torch.Generator().manual_seed(3)
pages = 5
raw = torch.randint(0, 256, (pages * S,), dtype=torch.uint8, generator=g)
kv = raw.as_strided((pages, P, 1, 584), (S, 584, 584, 1))
idx = torch.randint(-1, 2 * P, (4, 64), dtype=torch.int32, generator=g)   # pages 0 and 1
idx[3, :3] = torch.tensor([4 * P + 255, -1, 4 * P])                      # and 4
results = {}
for name, kernels in (("triton", (m._page_mark_kernel, m._page_split_kernel)),
                      ("stand-in", (flash_mla.page_mark_kernel, flash_mla.page_split_kernel))):
    m._page_mark_kernel, m._page_split_kernel = kernels
    bufs = get_resources().buffers
    bufs["flash_mla_sm120_split:cpu"] = torch.full((pages * 4, SS), 0xAB, dtype=torch.uint8)
    bufs["flash_mla_sm120_mask:cpu"] = torch.full((pages,), 7, dtype=torch.int8)   # stale mask
    out = m._split_kv_pages_to_64(kv, P, touched_indices=idx)
    results[name] = (bufs["flash_mla_sm120_split:cpu"].clone(), bufs["flash_mla_sm120_mask:cpu"].clone(),
                     tuple(out.shape), out.stride())
(a_buf, a_mask, a_shape, a_stride), (b_buf, b_mask, b_shape, b_stride) = results["triton"], results["stand-in"]
print("REPORT " + json.dumps({"buffer_equal": bool(torch.equal(a_buf, b_buf)),
                              "mask_equal": bool(torch.equal(a_mask, b_mask)),
                              "mask": a_mask.tolist(), "view_equal": a_shape == b_shape and a_stride == b_stride,
                              "untouched_pages_kept": bool((a_buf[8:16] == 0xAB).all())}))
"""


def test_split_stand_ins_equal_the_triton_kernels_under_the_interpreter():
    """The same engine function, once with its real Triton kernels (Triton's CPU interpreter;
    TRITON_INTERPRET must be set before the engine imports, hence a child) and once with the
    stand-ins: the same persistent buffer bytes and the same mask."""
    proc = run_python(INTERPRETER_CHILD, env={"TRITON_INTERPRET": "1"}, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["mask"] == [1, 1, 0, 0, 1]
    assert report["buffer_equal"] and report["mask_equal"] and report["view_equal"], report
    assert report["untouched_pages_kept"]


def _call(g, rows, heads=8, topk=128, pages=4, extra=True, lengths=True, sink=True, extra_page=SP):
    """Keyword arguments as deepseek_v4_backend passes them to flash_mla_with_kvcache_sm120."""
    raw = _pool(g, pages)
    idx = torch.randint(0, pages * P, (rows, 1, topk), dtype=torch.int32, generator=g)
    idx[torch.rand(rows, 1, topk, generator=g) < 0.1] = -1
    topk_length = torch.randint(topk // 2, topk + 1, (rows,), dtype=torch.int32, generator=g)
    if rows > 1:
        topk_length[0] = 0                                          # a row with no SWA candidate
    kw = dict(q=torch.randn(rows, 1, heads, 512, generator=g).to(torch.bfloat16),
              k_cache=_view4(raw).view(torch.float8_e4m3fn), head_dim_v=512,
              softmax_scale=512 ** -0.5, indices=idx, topk_length=topk_length if lengths else None,
              attn_sink=torch.randn(heads, generator=g) if sink else None, extra_k_cache=None,
              extra_indices_in_kvcache=None, extra_topk_length=None)
    if extra:                                                       # a compressed (c4) cache
        stride = SS if extra_page == SP else S
        e_raw = _pool(g, 3, extra_page, stride)
        kw.update(extra_k_cache=_view4(e_raw, extra_page, stride).view(torch.float8_e4m3fn),
                  extra_indices_in_kvcache=torch.randint(-1, 3 * extra_page, (rows, 1, 64), dtype=torch.int32,
                                                         generator=g),
                  extra_topk_length=torch.randint(1, 65, (rows,), dtype=torch.int32, generator=g)
                  if lengths else None)
    return kw


def _torch_decode(m, kw):
    return m._sm120_sparse_decode_fwd(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"],
                                      kw["attn_sink"], 512, kw["softmax_scale"], kw["extra_k_cache"],
                                      kw["extra_indices_in_kvcache"], kw["extra_topk_length"])


@pytest.mark.parametrize("rows, path", [(4, "decode"), (70, "prefill")])
@pytest.mark.parametrize("extra", [False, True])
def test_stock_route_through_the_split_equals_the_torch_decode_in_place(engine, monkeypatch, capfd,
                                                                        rows, path, extra):
    """flash_mla_with_kvcache_sm120 with the engine's flashinfer backend (split to 64-token pages,
    then the stand-in) gives what the engine's torch decode gives on the 256-token pages: the
    same bytes are gathered and go through the same einsums (in CHUNK-token slices)."""
    monkeypatch.setattr(engine, "_sm120_default_backend", "flashinfer")
    g = torch.Generator().manual_seed(rows)
    kw = _call(g, rows, extra=extra)
    want, _ = _torch_decode(engine, kw)
    first = None
    for _ in range(2):
        got, lse = engine.flash_mla_with_kvcache_sm120(**kw)
        assert lse is None and got.shape == (rows, 1, 8, 512) and got.dtype == torch.bfloat16
        assert_decode_close(got, want)
        if first is not None:
            assert torch.equal(got, first)          # the same call again: the same computation
        first = got
    assert bool(torch.isfinite(want).all())
    if not extra:
        assert bool((want[0] == 0).all())                           # topk_length 0: output 0
    err = capfd.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[dsv41-cpu] dsv4 page split:")]
    assert len(lines) == 1 and lines[0].startswith(f"[dsv41-cpu] dsv4 page split: {path}, {rows} rows: "), err


def _fast_decode(kw):
    return flash_mla._sparse_decode(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"], kw["attn_sink"],
                                    512, kw["softmax_scale"], kw["extra_k_cache"],
                                    kw["extra_indices_in_kvcache"], kw["extra_topk_length"])


@pytest.mark.parametrize("rows", [1, 4, 70])                        # 70: several CHUNKs, the last short
@pytest.mark.parametrize("extra_page", [None, SP, 256])             # no extra cache; 64- / 256-token pages
@pytest.mark.parametrize("lengths, sink", [(True, True), (False, False), (True, False), (False, True)])
def test_stand_in_decode_equals_the_engines_torch_decode_bitwise(engine, rows, extra_page, lengths, sink):
    """The stand-in's computation is the engine's `_sm120_sparse_decode_fwd` reorganised (each
    referenced row dequantised once, gathered by index, CHUNK query tokens at a time): the same
    output and natural-log LSE on the 256-token view (assert_decode_close); and through the
    stand-in's entry on the engine's 64-token split view, the same output and the base-2,
    sink-including LSE computed from the engine's LSE (and bit for bit what the stand-in gives
    on the 256-token view)."""
    assert rows < flash_mla.CHUNK or (rows > 2 * flash_mla.CHUNK and rows % flash_mla.CHUNK)
    g = torch.Generator().manual_seed(100 + rows)
    kw = _call(g, rows, extra=extra_page is not None, lengths=lengths, sink=sink, extra_page=extra_page or SP)
    want, want_lse = _torch_decode(engine, kw)
    got, got_lse = _fast_decode(kw)
    assert got.dtype == want.dtype and got.shape == want.shape and got_lse.shape == want_lse.shape
    assert_decode_close(got, want, got_lse, want_lse)
    if lengths and rows > 1 and extra_page is None:                 # row 0: no candidate
        assert bool((want[0] == 0).all()) and bool(torch.isneginf(want_lse[0]).all())
    else:
        assert bool(torch.isfinite(want_lse).all())
    kv64 = engine._split_kv_pages_to_64(kw["k_cache"].view(torch.uint8), P, touched_indices=kw["indices"].squeeze(1))
    out, out_lse = torch.empty(rows, 8, 512, dtype=torch.bfloat16), torch.empty(rows, 8)
    extra = kw["extra_k_cache"]
    flash_mla.sparse_mla_sm120_paged_attention(
        kw["q"].squeeze(1), kv64, kw["indices"].squeeze(1), out, out_lse, kw["softmax_scale"],
        topk_length=kw["topk_length"], attn_sink=kw["attn_sink"],
        extra_kv_cache=None if extra is None else extra.view(torch.uint8),
        extra_indices=None if extra is None else kw["extra_indices_in_kvcache"].squeeze(1),
        extra_topk_length=kw["extra_topk_length"])
    natural = want_lse.reshape(rows, 8)
    if sink:
        natural = torch.logaddexp(natural, kw["attn_sink"].view(1, 8))
    assert_decode_close(out, want.squeeze(1), out_lse, natural * flash_mla.LOG2E)
    # the 64-token view holds the same bytes: through it, the stand-in's own bits on the 256-token
    # view (the same computation on the same values)
    own, own_lse = got.squeeze(1), got_lse.reshape(rows, 8)
    if sink:
        own_lse = torch.logaddexp(own_lse, kw["attn_sink"].view(1, 8))
    assert torch.equal(out, own) and torch.equal(out_lse, own_lse * flash_mla.LOG2E)


@pytest.mark.parametrize("chunk", [1, 7, 100])
def test_stand_in_decode_does_not_depend_on_the_chunk(engine, monkeypatch, chunk):
    """CHUNK only sizes the reused gather buffer: one token at a time, ragged chunks, or the
    whole call in one give the engine's result (assert_decode_close: other slice shapes, so
    another summation order is allowed)."""
    monkeypatch.setattr(flash_mla, "CHUNK", chunk)
    kw = _call(torch.Generator().manual_seed(7), 70, extra=True)
    want, want_lse = _torch_decode(engine, kw)
    got, got_lse = _fast_decode(kw)
    assert_decode_close(got, want, got_lse, want_lse)


def test_stand_in_writes_output_and_base2_lse_with_the_sink(engine):
    """FlashInfer's output contract: output [T, H, 512] bf16 and out_lse [T, H] float32 in place,
    LSE in base 2 (times lse_scale) including the sink's mass; an empty row has output 0 and
    LSE = sink * log2(e) (or -inf without a sink)."""
    g = torch.Generator().manual_seed(5)
    kw = _call(g, 3, extra=False)
    kw["topk_length"][1] = 0
    want, lse_e = _torch_decode(engine, kw)
    kv = kw["k_cache"].view(torch.uint8)
    for sink, lse_scale in ((kw["attn_sink"], 1.0), (None, math.log(2.0))):
        out = torch.full((3, 8, 512), 7.0, dtype=torch.bfloat16)
        out_lse = torch.full((3, 8), 7.0)
        if sink is None:
            want, lse_e = engine._sm120_sparse_decode_fwd(kw["q"], kw["k_cache"], kw["indices"],
                                                          kw["topk_length"], None, 512, kw["softmax_scale"])
        assert flash_mla.sparse_mla_sm120_paged_attention(
            kw["q"].squeeze(1), kv, kw["indices"].squeeze(1), out, out_lse, kw["softmax_scale"],
            topk_length=kw["topk_length"], attn_sink=sink, lse_scale=lse_scale) is None
        assert_decode_close(out, want.squeeze(1))
        natural = lse_e.squeeze(-1)
        if sink is not None:
            natural = torch.logaddexp(natural, sink.view(1, -1))
        torch.testing.assert_close(out_lse, natural / math.log(2.0) * lse_scale)
        assert bool((out[1] == 0).all())
        if sink is None:
            assert bool(torch.isneginf(out_lse[1]).all())
        else:
            torch.testing.assert_close(out_lse[1], sink / math.log(2.0))


def test_stand_in_refuses_what_it_does_not_model(engine):
    g = torch.Generator().manual_seed(6)
    kw = _call(g, 2, extra=True)
    base = dict(q=kw["q"].squeeze(1), kv_cache=kw["k_cache"].view(torch.uint8), indices=kw["indices"],
                output=torch.empty(2, 8, 512, dtype=torch.bfloat16), out_lse=torch.empty(2, 8),
                sm_scale=0.04)
    with pytest.raises(ValueError, match="together"):
        flash_mla.sparse_mla_sm120_paged_attention(**base, extra_kv_cache=kw["extra_k_cache"])
    with pytest.raises(NotImplementedError, match="DSV4 footer-scale"):
        flash_mla.sparse_mla_sm120_paged_attention(**dict(base, q=torch.zeros(2, 8, 576, dtype=torch.bfloat16)))
    with pytest.raises(NotImplementedError):
        flash_mla.sparse_mla_sm120_paged_attention(**base, kv_scale_format="ue8m0_g32")


def test_engine_imports_find_the_stand_in_module_only_by_its_name(engine):
    """The engine's call-time import resolves to the stand-in; flashinfer itself still does not
    import here (the stand-in answers one module name, nothing above it)."""
    from flashinfer.mla._sparse_mla_sm120 import _DECODE_MAX_TOKENS, _sparse_mla_sm120_paged_attention

    assert _DECODE_MAX_TOKENS == 64
    assert _sparse_mla_sm120_paged_attention is flash_mla.sparse_mla_sm120_paged_attention
    assert "flashinfer" not in sys.modules and "flashinfer.mla" not in sys.modules
    # the engine's capability probe (attention TP > 1 only) fails closed: no DSV4 dispatch table
    engine._flashinfer_dsv4_decode_capabilities.cache_clear()
    try:
        assert engine.flashinfer_dsv4_decode_supports_num_heads(8, 1) is False
    finally:
        engine._flashinfer_dsv4_decode_capabilities.cache_clear()
