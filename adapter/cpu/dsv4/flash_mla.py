"""The engine's stock SM12x decode route (`SGLANG_SM120_FLASHMLA_BACKEND=flashinfer`, production's
value) on CPU: the stand-ins for what it launches on a GB10.

CPU servers and tests only (installed by adapter.cpu.dsv4.install); nothing in production
imports this. The engine's own Python runs unchanged: `flash_mla_with_kvcache_sm120` ->
`_flash_mla_flashinfer` (<= 64 query rows) or `_flash_mla_sm120_prefill` (more), each calling
`_split_kv_pages_to_64`, which zeroes its persistent mask, launches `_page_mark_kernel`, launches
`_page_split_kernel` into its persistent grow-only buffer and returns the 64-token page view; then
FlashInfer's `_sparse_mla_sm120_paged_attention`. Stood in here, one function each:

  * `page_mark_kernel`, `page_split_kernel`: the two Triton kernels (launched `kernel[grid](...)`
    by the engine's `_split_kv_pages_to_64`, which stays the engine's own: its buffers, its mask,
    its grid and the strided view it returns);
  * `sparse_mla_sm120_paged_attention`: FlashInfer's SM120 sparse MLA entry. flashinfer-python
    0.7.2 cannot be imported here (`flashinfer/utils.py` imports pynvml at package import, and
    the kernel is CUDA-JIT for sm_120a/sm_121a only), so the engine's call-time
    `from flashinfer.mla._sparse_mla_sm120 import ...` is answered by a module of that one name
    (`flashinfer_module()`, put in sys.modules): `import flashinfer` itself still fails as before.

The split is observable: one `[dsv41-cpu] dsv4 page split: ...` line per distinct (decode |
prefill, query rows), from the split kernel's stand-in.
"""
from __future__ import annotations

import functools
import math
import sys
import types

import torch

ENGINE_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
FLASHINFER_MODULE = "flashinfer.mla._sparse_mla_sm120"
DECODE_MAX_TOKENS = 64          # flashinfer.mla._sparse_mla_sm120._DECODE_MAX_TOKENS (0.7.2 _policy.py)
D_QK_DSV4, D_V_DSV4 = 512, 512  # the DSV4 footer-scale cache: d_qk 512 with kv_scale_format "auto"
LOG2E = 1.0 / math.log(2.0)

# The engine function that called the split, by name -> the path it is on.
_PATHS = {"_flash_mla_flashinfer": "decode", "_flash_mla_sm120_prefill": "prefill"}
_logged: set = set()


class _Launch:
    """`kernel[grid](*args)`, the way the engine launches a Triton kernel, for a torch function
    `fn(grid, *args)`."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__, self.__doc__ = fn.__name__, fn.__doc__

    def __getitem__(self, grid):
        return functools.partial(self.fn, tuple(grid) if isinstance(grid, (tuple, list)) else (grid,))


def _page_mark(grid, indices_ptr, mask_ptr, n_idx, SRC_PBS, BLOCK):
    """Stand-in for flash_mla_sm120._page_mark_kernel (production: that Triton kernel), its rule:
    every valid token index (the first `n_idx`, >= 0) marks its source page,
    mask[index // SRC_PBS] = 1 (int8); -1 marks nothing. The grid covers n_idx in BLOCKs."""
    n = min(int(n_idx), grid[0] * int(BLOCK))
    idx = indices_ptr.reshape(-1)[:n].to(torch.int64)
    pages = idx[idx >= 0] // int(SRC_PBS)
    mask_ptr[pages] = 1


def _page_split(grid, src_ptr, dst_ptr, N_pages, src_stride0, dst_stride0, DATA_PER_SUB,
                SCALE_PER_SUB, SRC_SCALE_OFF, DST_SCALE_OFF, RATIO, BLOCK_SIZE, mask_ptr, HAS_MASK):
    """Stand-in for flash_mla_sm120._page_split_kernel (production: that Triton kernel), its
    rule: program `pid` of grid (N_pages * RATIO,) copies source page p = pid // RATIO, sub-page
    s = pid % RATIO, into destination page p * RATIO + s: DATA_PER_SUB data bytes from
    src[p, s * DATA_PER_SUB] to dst[.., 0], and SCALE_PER_SUB scale bytes from
    src[p, SRC_SCALE_OFF + s * SCALE_PER_SUB] to dst[.., DST_SCALE_OFF]; with HAS_MASK only pages
    whose mask byte is set are copied (the rest of the buffer keeps its stale bytes; the padding
    after a destination page's scales is never written)."""
    n_pages, ratio = int(N_pages), int(RATIO)
    src = src_ptr.view(torch.uint8).reshape(src_ptr.shape[0], -1)[:, :src_stride0]
    dst = dst_ptr.view(torch.uint8).reshape(dst_ptr.shape[0], dst_stride0)
    programs = min(grid[0], n_pages * ratio)
    pages = torch.arange(-(-programs // ratio))
    if HAS_MASK:
        pages = pages[mask_ptr[:pages.numel()] != 0]
    if pages.numel():
        rows = src[pages]
        data = rows[:, :ratio * DATA_PER_SUB].reshape(-1, ratio, DATA_PER_SUB)
        scale = rows[:, SRC_SCALE_OFF:SRC_SCALE_OFF + ratio * SCALE_PER_SUB].reshape(-1, ratio, SCALE_PER_SUB)
        subs = dst[:n_pages * ratio].view(n_pages, ratio, dst_stride0)
        subs[pages, :, :DATA_PER_SUB] = data
        subs[pages, :, DST_SCALE_OFF:DST_SCALE_OFF + SCALE_PER_SUB] = scale
    _log_split(n_pages, int(pages.numel()), ratio)


def _log_split(n_pages: int, touched: int, ratio: int) -> None:
    """One line per distinct (path, query rows): read from the engine frames that launched the
    split (`_split_kv_pages_to_64`'s touched_indices, and the function that called it)."""
    path, rows = "other", -1
    frame = sys._getframe(2)                           # _split_kv_pages_to_64 (1: _page_split)
    if frame.f_code.co_name == "_split_kv_pages_to_64":
        touched_indices = frame.f_locals.get("touched_indices")
        if touched_indices is not None and touched_indices.dim() >= 1:
            rows = int(touched_indices.shape[0])
        caller = frame.f_back
        path = _PATHS.get(caller.f_code.co_name, caller.f_code.co_name) if caller else "other"
    if (path, rows) in _logged:
        return
    _logged.add((path, rows))
    sys.stderr.write(f"[dsv41-cpu] dsv4 page split: {path}, {rows} rows: {touched} of {n_pages} "
                     f"256-token pages copied into {ratio} x 64-token pages (the stock split; "
                     "logged once per path and row count)\n")


page_mark_kernel = _Launch(_page_mark)
page_split_kernel = _Launch(_page_split)


def _nhd(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache in the form `_sm120_sparse_decode_fwd` reads ([blocks, page, 1, bytes]) from
    any form FlashInfer accepts: 3-D [blocks, page, bytes], HND [blocks, 1, page, bytes], NHD."""
    if cache.dim() == 3:
        return cache.unsqueeze(2)
    if cache.dim() == 4 and cache.shape[1] == 1 and cache.shape[2] != 1:
        return cache.transpose(1, 2)
    return cache


_NOPE, _ROPE_BYTES, _TILES, _TILE = 448, 128, 7, 64    # the engine's _NOPE_DIM, 2 * _ROPE_DIM, _NUM_TILES, _TILE_SIZE
_ROW, _SCALE_ROW = 576, 8                               # _NOPE_ROPE_STRIDE, _SCALE_STRIDE
CHUNK = 16      # query tokens per gathered float32 block (a c4 prefill chunk: 16 x 640 x 2 KiB = 20 MiB)


def _dequant_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The engine's `_gather_and_dequant` rule for the token rows `rows` (>= 0) of a footer-format
    paged cache [pages, page, 1, 584] (any page stride): row r is token r % page of page
    r // page; its 448 fp8 nope bytes times its 7 e8m0 tile scales in float32, to bf16, then its
    64 bf16 rope values. [len(rows), 512] bf16, the same elementwise ops as the engine's."""
    pages, page = cache.shape[0], cache.shape[1]
    stride = cache.stride(0)
    raw = cache.as_strided((pages, stride), (stride, 1)).view(torch.uint8)
    page_idx, offset = rows // page, rows % page
    data = raw[:, :page * _ROW].view(pages, page, _ROW)[page_idx, offset]                # [N, 576]
    scale = raw[:, page * _ROW:page * (_ROW + _SCALE_ROW)].view(pages, page, _SCALE_ROW)[page_idx, offset]
    n = rows.numel()
    out = torch.empty(n, _NOPE + _ROPE_BYTES // 2, dtype=torch.bfloat16)
    out[:, :_NOPE] = (data[:, :_NOPE].view(torch.float8_e4m3fn).view(n, _TILES, _TILE).float()
                      * scale[:, :_TILES].contiguous().view(torch.float8_e8m0fnu).view(n, _TILES, 1).float()
                      ).view(n, _NOPE).to(torch.bfloat16)
    out[:, _NOPE:] = data[:, _NOPE:].contiguous().view(torch.bfloat16)
    return out


def _invalid(idx: torch.Tensor, length) -> torch.Tensor:
    """The engine's mask: index < 0, or position >= the row's top-k length."""
    invalid = idx < 0
    if length is not None:
        invalid = invalid | (torch.arange(idx.shape[-1]).view(1, 1, -1) >= length.view(-1, 1, 1))
    return invalid


def _sparse_decode(q, kv_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
                   extra_kv_cache=None, extra_indices=None, extra_topk_length=None):
    """`flash_mla_sm120._sm120_sparse_decode_fwd` (same arguments: q [T, 1, H, 512], caches
    [pages, page, 1, 584], indices [T, 1, topk]; same (out, lse) returns), reorganised, not
    rewritten: the engine gathers and dequantises one row per (query token, candidate) -- a byte
    index per element -- into one [T, 1, topk, 512] tensor, then zeroes the masked candidates.
    Here each referenced cache row is dequantised once (the unique valid rows of the call, by the
    engine's elementwise rule) into a float32 table whose row 0 is zero, and the candidates are
    gathered from it by index (masked ones from row 0): the engine's `gathered_kv.float()` value
    for value, `CHUNK` query tokens at a time into one reused buffer. Each chunk goes through the
    engine's own einsums (the same per-token [H, 512] x [512, topk] products); the mask, scale,
    logsumexp, sink and exp are the engine's ops on the whole call's scores, in its order. So the
    bits are the engine's bits: tests/test_cpu_dsv4_flash_mla.py checks torch.equal against
    `_sm120_sparse_decode_fwd` (output and LSE; decode and multi-chunk prefill sizes)."""
    tokens, H_q = q.shape[0], q.shape[2]
    parts = [(kv_cache, indices, _invalid(indices, topk_length))]
    if extra_kv_cache is not None and extra_indices is not None:
        parts.append((extra_kv_cache, extra_indices, _invalid(extra_indices, extra_topk_length)))
    tables, slots, base = [torch.zeros(1, _NOPE + _ROPE_BYTES // 2, dtype=torch.bfloat16)], [], 1
    for cache, idx, invalid in parts:
        flat = idx.reshape(-1).to(torch.int64)
        keep = ~invalid.reshape(-1)
        rows, inverse = torch.unique(flat[keep], return_inverse=True)
        tables.append(_dequant_rows(cache, rows))
        slot = torch.zeros_like(flat)
        slot[keep] = inverse + base
        slots.append(slot.view(tokens, -1))
        base += rows.numel()
    table = torch.cat(tables).float()                  # [1 + rows, 512]: the bf16 values, exactly
    slot = slots[0] if len(slots) == 1 else torch.cat(slots, dim=1)
    invalid_mask = parts[0][2] if len(parts) == 1 else torch.cat([p[2] for p in parts], dim=2)
    topk, width = slot.shape[1], table.shape[1]
    buf = torch.empty(min(tokens, CHUNK) * topk, width)

    def kv_f(start, stop):                             # the engine's kv_f[start:stop]
        n = (stop - start) * topk
        torch.index_select(table, 0, slot[start:stop].reshape(-1), out=buf[:n])
        return buf[:n].view(stop - start, 1, topk, width)

    q_f = q.float()
    chunks = [(i, min(i + CHUNK, tokens)) for i in range(0, max(tokens, 1), CHUNK)]
    scores = torch.cat([torch.einsum("bshd,bstd->bsht", q_f[i:j], kv_f(i, j)) for i, j in chunks]) \
        if len(chunks) != 1 else torch.einsum("bshd,bstd->bsht", q_f, kv_f(0, tokens))
    scores = scores * softmax_scale
    scores.masked_fill_(invalid_mask.unsqueeze(2).expand_as(scores), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if attn_sink is not None:
        lse_for_out = torch.logsumexp(
            torch.stack([lse, attn_sink.view(1, 1, H_q).expand_as(lse)], dim=0), dim=0)
    else:
        lse_for_out = lse.clone()
    lonely = lse == float("-inf")
    lse_for_out[lonely] = float("inf")
    weights = torch.exp(scores - lse_for_out.unsqueeze(-1))
    if len(chunks) == 1:                               # the buffer still holds the whole call
        out = torch.einsum("bsht,bstv->bshv", weights, buf.view(tokens, 1, topk, width)[..., :head_dim_v])
    else:
        out = torch.cat([torch.einsum("bsht,bstv->bshv", weights[i:j], kv_f(i, j)[..., :head_dim_v])
                         for i, j in chunks])
    out[lonely.unsqueeze(-1).expand_as(out)] = 0.0
    return out.to(torch.bfloat16), lse.permute(0, 2, 1)


def sparse_mla_sm120_paged_attention(q, kv_cache, indices, output, out_lse, sm_scale, *, d_v=D_V_DSV4,
                                     kv_scale_format="auto", topk_length=None, attn_sink=None,
                                     extra_kv_cache=None, extra_indices=None, extra_topk_length=None,
                                     mid_out=None, mid_lse=None, prefill_impl=None, extra_fp4=False,
                                     lse_scale=1.0):
    """Stand-in for flashinfer.mla._sparse_mla_sm120._sparse_mla_sm120_paged_attention
    (flashinfer-python 0.7.2; production: its SM120 decode / prefill kernels, CUDA-JIT), for the
    DSV4 footer-scale cache (d_qk 512, kv_scale_format "auto") the engine's DeepSeek-V4 route
    passes. Same signature; mutates `output` and `out_lse` in place and returns None, as there:
    output [T, H, d_v] bf16; out_lse [T, H] float32 in base 2 times `lse_scale`, with the sink's
    mass (FlashMLA V4: lse' = log(exp(lse) + exp(sink))); a row with no valid candidate has
    output 0 and LSE -inf, or the sink's. Computed by `_sparse_decode`: the engine's torch sparse
    decode `_sm120_sparse_decode_fwd` reorganised to dequantise each referenced cache row once
    (bitwise equal to the engine's function, checked by the tests), on the cache as given (after
    the engine's split: 64-token pages). The split-K scratch (mid_out / mid_lse) and prefill_impl
    only steer FlashInfer's kernels: accepted, not used."""
    if (extra_kv_cache is None) != (extra_indices is None):
        raise ValueError("extra_kv_cache and extra_indices must be provided together")
    if extra_kv_cache is None and extra_topk_length is not None:
        raise ValueError("extra_topk_length requires extra_kv_cache and extra_indices")
    if q.shape[-1] != D_QK_DSV4 or kv_scale_format != "auto" or extra_fp4:
        raise NotImplementedError("the CPU stand-in serves the DSV4 footer-scale FP8 cache only "
                                  f"(d_qk {D_QK_DSV4}, kv_scale_format 'auto'), got d_qk "
                                  f"{q.shape[-1]}, {kv_scale_format!r}, extra_fp4={extra_fp4}")
    if d_v != D_V_DSV4:
        raise ValueError(f"d_v {d_v}: DSV4 has d_v {D_V_DSV4}")
    q3 = q.reshape(q.shape[0], q.shape[-2], q.shape[-1])
    tokens, heads = q3.shape[:2]
    idx = indices.reshape(tokens, 1, indices.shape[-1])
    extra_idx = None if extra_indices is None else extra_indices.reshape(tokens, 1, extra_indices.shape[-1])
    out, lse = _sparse_decode(
        q3.unsqueeze(1), _nhd(kv_cache), idx, topk_length, attn_sink, d_v, sm_scale,
        None if extra_kv_cache is None else _nhd(extra_kv_cache), extra_idx, extra_topk_length)
    output.view(tokens, heads, d_v).copy_(out.view(tokens, heads, d_v))
    lse = lse.reshape(tokens, heads).float()           # natural log, without the sink
    if attn_sink is not None:
        lse = torch.logaddexp(lse, attn_sink.float().view(1, heads))
    out_lse.view(tokens, heads).copy_(lse * (LOG2E * lse_scale))


def flashinfer_module() -> types.ModuleType:
    """The module the engine's call-time `from flashinfer.mla._sparse_mla_sm120 import
    _sparse_mla_sm120_paged_attention, _DECODE_MAX_TOKENS` finds (FlashInfer's own cannot import
    on CPU: see the module docstring). Only those two names: the engine's capability probe
    (`_flashinfer_dsv4_decode_capabilities`, read at attention TP > 1 only) finds no
    `_DECODE_DSV4_DISPATCH` and answers "unsupported", its fail-closed path."""
    import importlib.machinery

    module = types.ModuleType(FLASHINFER_MODULE, "CPU stand-in (adapter/cpu/dsv4/flash_mla.py)")
    module.__spec__ = importlib.machinery.ModuleSpec(FLASHINFER_MODULE, None, origin=__file__)
    module.__file__ = __file__
    module._DECODE_MAX_TOKENS = DECODE_MAX_TOKENS
    module._sparse_mla_sm120_paged_attention = sparse_mla_sm120_paged_attention
    return module


def install_flashinfer() -> bool:
    """Answer `flashinfer.mla._sparse_mla_sm120` with the stand-in module (once per process)."""
    current = sys.modules.get(FLASHINFER_MODULE)
    if current is not None and getattr(current, "__file__", None) == __file__:
        return False
    sys.modules[FLASHINFER_MODULE] = flashinfer_module()
    return True
