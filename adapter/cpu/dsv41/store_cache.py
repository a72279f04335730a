"""Stand-in for sglang.kernels.ops.attention.dsv4.attn.fused_store_cache (a CUDA-JIT build of
deepseek_v4/store.cuh, `FusedStoreCacheFlashMLAKernel` / `FusedStoreCacheIndexerKernel`), which
mem_cache/deepseek_v4_memory_pool.py imports by name: the compressed-KV store of the V4.1
ratio-1/2 kv-source layers (`set_key_buffer_fused`) and the SWA store of the radix path.

CPU servers only (installed by adapter.cpu.dsv41.install); nothing in production imports this.
Off SM100 the engine keeps the V4 page layout (`select_dsv4_kv_layout`: "auto" -> V4), the only
layout modelled here; the V4.1 layouts (V41 / V41_FP4, in-kernel RoPE) raise. Rules from
store.cuh:
- flashmla (V4): per 64-wide tile of the 448 nope dims, scale = max(1e-4, amax) / 448 rounded
  up to a power of two (`cast_to_ue8m0`: exponent + (mantissa != 0)), fp8 e4m3 of x / scale and
  the ue8m0 byte; the 64 rope dims copied as bf16 (written by the engine kit's
  `set_k_and_s_torch`, adapter.cpu.dsv4.attention.store_k's writer);
- indexer: one fp32 scale per row = max(1e-4, amax) / 448, fp8 of x / scale (128 bytes), the
  scale after the page's data (adapter.cpu.dsv4.attention.store_index_k).
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
NOPE, TILE = 448, 64


def pack_v4(k: torch.Tensor):
    """store.cuh's V4 row of bf16 rows [n, 512] as the kit's (fp8 nope, bf16 rope, ue8m0) pack."""
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    n = k.shape[0]
    tiles = k[:, :NOPE].float().view(n, NOPE // TILE, TILE)
    raw = tiles.abs().amax(-1).clamp_min(1e-4) / FP8_MAX
    bits = raw.contiguous().view(torch.int32)
    exp = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)      # cast_to_ue8m0
    scale = (exp << 23).view(torch.float32)
    scaled = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return NopeFp8RopeBf16Pack(
        k_nope_fp8=scaled.view(n, NOPE).to(FP8).contiguous(),
        k_rope_bf16=k[:, NOPE:].to(torch.bfloat16).contiguous(),
        scale_k_nope_ue8m0=exp.to(torch.uint8).contiguous())


def fused_store_cache(input: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, *,
                      page_size: int, type: str, layout="v4", freqs_cis=None) -> None:
    """Stand-in for dsv4.attn.fused_store_cache (production: CUDA-JIT store.cuh): quantize rows
    and write them at `indices` of the paged cache. V4 layout only."""
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    from adapter.cpu.dsv4.attention import store_index_k
    from adapter.cpu.dsv41.fp4_index_k import first_call

    layout = KVLayout.parse(layout)
    if layout is not KVLayout.V4 or freqs_cis is not None:
        raise NotImplementedError(f"CPU stand-in for fused_store_cache: V4 layout only, not {layout}")
    first_call(f"fused_store_cache/{type}", f"first call: {input.shape[0]} rows, {layout.value} layout")
    if input.shape[0] == 0:
        return
    if type == "flashmla":
        from sglang.test.kernels.deepseek_v4.k_cache_reference import set_k_and_s_torch

        assert input.shape[-1] == NOPE + TILE
        set_k_and_s_torch(cache, indices.to(torch.int64).contiguous(), pack_v4(input), page_size)
    elif type == "indexer":
        store_index_k(cache.view(cache.shape[0], -1), indices, input, page_size)
    else:
        raise ValueError(f"fused_store_cache type {type!r}")
