"""CPU reference (torch) of FlashInfer's sparse DSV4 decode that reads raw page bytes the way the
kernel does (include/flashinfer/attention/sparse_mla_sm120/kernels/fp8_decode/decode.cuh,
common/kv_cache_io.cuh, model/kv_storage.cuh FooterScaleLayout in flashinfer-python 0.7.2):

  token index i >= 0:  page = i / page_tokens, row = i - page * page_tokens
  data  = pool[page * page_stride + row * 576 : +576]   448 B fp8 e4m3 nope | 64 x bf16 rope
  scale = pool[page * page_stride + page_tokens * 576 + row * 8 : +8]
          7 UE8M0 exponents (one per 64-wide nope tile) + 1 pad byte
  i < 0, or a slot at or past topk_length: the kernel gathers a zero row and masks the score.

K = V = [nope * 2^(e - 127) per 64-wide tile | rope]  (512 wide; d_v = 512 for DSV4).
Attention per query row t, head h over its candidates (main then extra cache):
  s = q . k * sm_scale;  lse = logsumexp(s);  o = softmax(s) @ v
  attn_sink: o *= exp(lse) / (exp(lse) + exp(sink))  (FlashMLA V4 convention); all masked -> 0.

The arithmetic is float64 on CPU: this reference is for byte layout (which bytes each candidate
reads), not a numerical model of the tensor-core kernel. Two decodes whose gathered rows are the
same bytes produce identical bits here, whatever page geometry they read them through.
"""
from __future__ import annotations

from typing import Optional

import torch

# The row layout (448 B nope, 64 bf16 rope, 8 scale bytes; 7 tiles of 64) and the padded page
# stride are the adapter's: one definition (adapter/swan/layout.py).
from adapter.swan.layout import (DATA_BYTES, NOPE, ROPE, ROW_BYTES, SCALE_BYTES,  # noqa: F401
                                 SPLIT_PAGE_TOKENS, TILE, TILES, page_stride_for)
from adapter.swan.layout import D_QK as D
from adapter.swan.layout import PAGE_TOKENS


def raw_bytes(pages: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a paged pool given as [N, page_tokens, 1, 584] (or [N, page_stride])
    whose stride(0) is the page stride: every byte from the first page to the end of the last."""
    assert pages.element_size() == 1
    n = pages.shape[0]
    stride = pages.stride(0)
    return torch.as_strided(pages.view(torch.uint8), (n * stride,), (1,))


def gather_rows(pool: torch.Tensor, indices: torch.Tensor, page_tokens: int, page_stride: int):
    """Per candidate: (data bytes [.., 576], scale bytes [.., 8], valid [..]) read from `pool`
    (flat uint8) with the kernel's footer addressing. Invalid candidates read the zero row."""
    assert pool.dtype == torch.uint8 and pool.dim() == 1
    idx = indices.to(torch.int64)
    valid = idx >= 0
    safe = torch.where(valid, idx, torch.zeros_like(idx))
    page = safe // page_tokens
    row = safe - page * page_tokens
    base = page * page_stride
    data_off = (base + row * DATA_BYTES).unsqueeze(-1) + torch.arange(DATA_BYTES)
    scale_off = (base + page_tokens * DATA_BYTES + row * SCALE_BYTES).unsqueeze(-1) + torch.arange(SCALE_BYTES)
    data = pool[data_off]
    scale = pool[scale_off]
    data = torch.where(valid.unsqueeze(-1), data, torch.zeros_like(data))
    scale = torch.where(valid.unsqueeze(-1), scale, torch.zeros_like(scale))
    return data, scale, valid


def dequant_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[.., 576] + [.., 8] bytes -> [.., 512] float64: fp8 e4m3 nope x 2^(e8m0 - 127) per tile,
    bf16 rope (little endian). Exact: an fp8 value times a power of two fits float64."""
    lead = data.shape[:-1]
    nope = data[..., :NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.float64)
    exps = scale[..., :TILES].to(torch.float64) - 127.0
    nope = (nope.reshape(*lead, TILES, TILE) * torch.exp2(exps).unsqueeze(-1)).reshape(*lead, NOPE)
    rope = data[..., NOPE:].contiguous().view(torch.bfloat16).to(torch.float64)
    return torch.cat([nope, rope], dim=-1)


def _candidates(pool, indices, topk_length, page_tokens, page_stride):
    data, scale, valid = gather_rows(pool, indices, page_tokens, page_stride)
    if topk_length is not None:
        pos = torch.arange(indices.shape[-1]).view(1, -1)
        valid = valid & (pos < topk_length.to(torch.int64).view(-1, 1))
    kv = dequant_rows(data, scale)
    kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros_like(kv))
    return kv, valid


def sparse_decode(q: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, *, page_tokens: int,
                  page_stride: int, sm_scale: float, topk_length: Optional[torch.Tensor] = None,
                  attn_sink: Optional[torch.Tensor] = None, extra=None):
    """q [T, H, 512] (any float dtype), indices [T, K] int32 token indices into `pool`.
    extra: optional (pool, indices, page_tokens, page_stride, topk_length) of the second cache.
    Returns (out [T, H, 512] float64, lse [T, H] float64, natural log; -inf where all masked)."""
    assert q.dim() == 3 and q.shape[-1] == D and indices.dim() == 2
    kv, valid = _candidates(pool, indices, topk_length, page_tokens, page_stride)
    if extra is not None:
        e_pool, e_idx, e_tokens, e_stride, e_len = extra
        e_kv, e_valid = _candidates(e_pool, e_idx, e_len, e_tokens, e_stride)
        kv = torch.cat([kv, e_kv], dim=1)
        valid = torch.cat([valid, e_valid], dim=1)
    qf = q.to(torch.float64)
    scores = torch.einsum("thd,tkd->thk", qf, kv) * sm_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isneginf(lse)
    weights = torch.exp(scores - torch.where(empty, torch.zeros_like(lse), lse).unsqueeze(-1))
    weights = weights.masked_fill(~valid.unsqueeze(1), 0.0)
    out = torch.einsum("thk,tkd->thd", weights, kv)
    if attn_sink is not None:
        sink = attn_sink.to(torch.float64).view(1, -1)
        out = out * torch.sigmoid(lse - sink).unsqueeze(-1)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(out), out)
    return out, lse


def split_mapping(src_pages: int, src_tokens: int = PAGE_TOKENS, dst_tokens: int = SPLIT_PAGE_TOKENS):
    """The byte mapping the engine's `_split_kv_pages_to_64` implements, as (dst_page, dst_off,
    src_page, src_off, length) runs: sub-page s of source page p becomes destination page
    p * ratio + s, whose data rows are source rows [s * 64, s * 64 + 64) and whose scale footer
    is the matching 64 * 8 bytes of the source footer. Used to cross-check the engine's output."""
    ratio = src_tokens // dst_tokens
    runs = []
    for p in range(src_pages):
        for s in range(ratio):
            d = p * ratio + s
            runs.append((d, 0, p, s * dst_tokens * DATA_BYTES, dst_tokens * DATA_BYTES))
            runs.append((d, dst_tokens * DATA_BYTES, p,
                         src_tokens * DATA_BYTES + s * dst_tokens * SCALE_BYTES,
                         dst_tokens * SCALE_BYTES))
    return runs
