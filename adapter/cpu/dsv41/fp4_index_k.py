"""Stand-ins for the DeepSeek-V4.1 fp4 index-K store (Triton), in plain torch:

- sglang.kernels.ops.quantization.fp4_indexer_quant.quantize_fp4_indexer_tensor
  (Triton `_quantize_fp4_indexer_kernel` / `_quantize_fp4_indexer_rows`);
- sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache.store_fp4_index_k_cache and
  gather_fp4_index_k (Triton `_store_fp4_index_k_cache_kernel` / `_gather_fp4_index_k_kernel`).

CPU servers only (installed by adapter.cpu.dsv41.install); nothing in production imports this.
The rules are the kernels' own, read from their Triton sources:
- a 128-value row is four groups of 32; each group's scale is the ue8m0 exponent of
  max(amax / 6, 1e-4) rounded up (bits: exponent + (mantissa != 0), clamped to [1, 254]);
- each value / 2^(exp - 127) becomes an e2m1 nibble (sign in bit 3): the default thresholds
  (> 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, saturating at 6), or round-half-to-even (`rne`:
  >= the thresholds, an odd code at an exact boundary drops to the even one); -0 codes as +0;
- element 2i goes to the low nibble of byte i, 2i+1 to the high one: payload int8 [n, 64]; the
  four exponents pack into one int32 (group g at bits 8g..8g+7);
- the index-K page is [page_size * 64 payload bytes | page_size * 4 scale bytes]; a token at
  slot `loc` writes page loc // page_size, offset loc % page_size.
"""
from __future__ import annotations

import sys

import torch

HEAD_DIM, GROUP, PAYLOAD, SCALE_BYTES = 128, 32, 64, 4
SLOT_BYTES = PAYLOAD + SCALE_BYTES
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


_SAID: set = set()


def first_call(name: str, detail: str) -> None:
    """One `[dsv41-cpu] dsv41 stand-in called: <name> (<detail>)` line per stand-in and process:
    the server's logs then show which stand-ins its traffic reached."""
    if name not in _SAID:
        _SAID.add(name)
        sys.stderr.write(f"[dsv41-cpu] dsv41 stand-in called: {name} ({detail})\n")


def ceil_ue8m0_exp(x: torch.Tensor) -> torch.Tensor:
    """The kernels' `_ceil_ue8m0_exp`: the fp32 exponent field, + 1 when a mantissa bit is set,
    clamped to [1, 254] (int32)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return exp.clamp(1, 254)


def e2m1_code(x: torch.Tensor, rne: bool = False) -> torch.Tensor:
    """`_fp4_e2m1_code` / `_fp4_e2m1_code_rne`: the e2m1 nibble of fp32 x (uint8, sign bit 3)."""
    ax = x.abs().clamp_max(6.0)
    idx = torch.zeros(x.shape, dtype=torch.uint8)
    for t in _THRESHOLDS:
        idx += ((ax >= t) if rne else (ax > t)).to(torch.uint8)
    if rne:
        boundary = torch.zeros(x.shape, dtype=torch.bool)
        for t in _THRESHOLDS:
            boundary |= ax == t
        idx = torch.where(boundary & ((idx & 1) == 1), idx - 1, idx)
    sign = ((x < 0) & (idx != 0)).to(torch.uint8)
    return idx | (sign << 3)


def quantize_fp4_indexer_tensor(x: torch.Tensor, rne: bool = False):
    """Stand-in for fp4_indexer_quant.quantize_fp4_indexer_tensor (production: Triton): per-32
    ue8m0 fp4 of rows [..., 128] -> (payload int8 [n, 64], packed exponents int32 [n])."""
    assert x.shape[-1] == HEAD_DIM
    rows = x.contiguous().view(-1, HEAD_DIM).float()
    groups = rows.view(-1, HEAD_DIM // GROUP, GROUP)
    exp = ceil_ue8m0_exp((groups.abs().amax(-1) / 6.0).clamp_min(1.0e-4))       # [n, 4]
    scale = (exp << 23).view(torch.float32)
    codes = e2m1_code((groups / scale[..., None]).view(-1, HEAD_DIM), rne=rne)
    payload = (codes[:, 0::2] & 0x0F) | ((codes[:, 1::2] & 0x0F) << 4)
    packed = exp[:, 0] | (exp[:, 1] << 8) | (exp[:, 2] << 16) | (exp[:, 3] << 24)
    return payload.view(torch.int8), packed.to(torch.int32)


def _columns(loc: torch.Tensor, page_size: int):
    loc = loc.to(torch.int64).view(-1)
    page, off = loc // page_size, loc % page_size
    payload = (off * PAYLOAD)[:, None] + torch.arange(PAYLOAD)
    scale = (page_size * PAYLOAD + off * SCALE_BYTES)[:, None] + torch.arange(SCALE_BYTES)
    return page[:, None], payload, scale


def store_fp4_index_k_cache(input: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *,
                            page_size: int, rne: bool = False) -> None:
    """Stand-in for dsv4_fp4_index_k_cache.store_fp4_index_k_cache (production: Triton
    `_store_fp4_index_k_cache_kernel` after `quantize_fp4_indexer_tensor`): quantize rows
    [n, 128] and write each at slot loc[i] of the index-K pages [pages, page_size * 68]."""
    assert input.shape[-1] == HEAD_DIM
    assert cache.shape[1] == page_size * SLOT_BYTES
    payload, packed = quantize_fp4_indexer_tensor(input.contiguous(), rne=rne)
    first_call("store_fp4_index_k_cache", f"first call: {payload.shape[0]} rows, rne={rne}")
    if payload.shape[0] == 0:
        return
    page, pcols, scols = _columns(loc, page_size)
    cache[page.expand_as(pcols), pcols] = payload.view(torch.uint8)
    shifts = torch.arange(0, 32, 8, dtype=torch.int32)
    cache[page.expand_as(scols), scols] = ((packed[:, None] >> shifts) & 0xFF).to(torch.uint8)


def gather_fp4_index_k(cache: torch.Tensor, slots: torch.Tensor, *, page_size: int):
    """Stand-in for dsv4_fp4_index_k_cache.gather_fp4_index_k (production: Triton
    `_gather_fp4_index_k_kernel`): (payload int8 [n, 64], packed exponents int32 [n]) at slots."""
    assert cache.shape[1] == page_size * SLOT_BYTES and cache.stride(1) == 1
    assert slots.is_contiguous()
    first_call("gather_fp4_index_k", f"first call: {slots.numel()} rows")
    page, pcols, scols = _columns(slots, page_size)
    payload = cache[page.expand_as(pcols), pcols].view(torch.int8).contiguous()
    scales = cache[page.expand_as(scols), scols].contiguous().view(torch.int32).view(-1)
    return payload, scales


# e2m1 nibble -> value (the fp4_indexer kernels' `_e2m1_decode`)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def dequantize_rows(cache: torch.Tensor, slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """bf16 index keys [n, 128] read from index-K pages: each nibble's value times its group's
    2^(exp - 127), rounded to bf16 (the decode kernel's `k_low` / `k_high`)."""
    page, pcols, scols = _columns(slots, page_size)
    u = cache[page.expand_as(pcols), pcols].to(torch.int64)
    codes = torch.stack([u & 0x0F, (u >> 4) & 0x0F], dim=-1).flatten(1)           # [n, 128]
    exps = cache[page.expand_as(scols), scols].to(torch.float32)                   # [n, 4]
    scale = torch.exp2(exps - 127.0).repeat_interleave(GROUP, dim=-1)
    return (E2M1_VALUES[codes] * scale).to(torch.bfloat16)
