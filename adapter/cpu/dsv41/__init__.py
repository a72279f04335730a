"""CPU stand-ins for the GPU kernels that only the DeepSeek-V4.1 forward reaches (on top of the
DeepSeek-V4 ones in adapter/cpu/dsv4/), one function each, grouped by the engine module they
stand in for:

    fp4_index_k.py   kvcache/dsv4_fp4_index_k_cache.store_fp4_index_k_cache / gather_fp4_index_k
                     and quantization/fp4_indexer_quant.quantize_fp4_indexer_tensor (Triton): the
                     ratio-1/2 index sources' fp4 index-K store (the pool's `set_index_fp4`)
    store_cache.py   attention/dsv4/attn.fused_store_cache (CUDA-JIT store.cuh): the ratio-1/2
                     kv sources' compressed-KV store, V4 page layout
    fp4_indexer.py   attention/dsv4/fp4_indexer.fp4_index_logits_decode (Triton): the ratio-1/2
                     index layers' decode logits

Tests, benches and CPU test servers only: `install()` runs from the CPU harness sitecustomize
(adapter/cpu/site/) when DSV41CPU_DSV41=1, which adapter/cpu/server.py sets for model="dsv41"
(beside DSV41CPU_DSV4=1: the V4 stand-ins stay armed). Nothing in production imports this
package. See docs/cpu_server.md ("DeepSeek-V4.1").
"""
from __future__ import annotations


def _stand_ins() -> dict:
    """{engine module: {name: stand-in}}: the defining modules and every module that binds the
    name with `from ... import` (rebinding only where the engine's original is bound)."""
    from adapter.cpu.dsv41 import fp4_index_k, fp4_indexer, store_cache

    quant = {"quantize_fp4_indexer_tensor": fp4_index_k.quantize_fp4_indexer_tensor}
    index_k = {"store_fp4_index_k_cache": fp4_index_k.store_fp4_index_k_cache,
               "gather_fp4_index_k": fp4_index_k.gather_fp4_index_k}
    store = {"fused_store_cache": store_cache.fused_store_cache}
    logits = {"fp4_index_logits_decode": fp4_indexer.fp4_index_logits_decode}
    return {
        "sglang.kernels.ops.quantization.fp4_indexer_quant": quant,
        "sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache": {**quant, **index_k},
        "sglang.kernels.ops.attention.dsv4.attn": store,
        "sglang.kernels.ops.attention.dsv4": store,
        "sglang.srt.mem_cache.deepseek_v4_memory_pool": store,
        "sglang.kernels.ops.attention.dsv4.fp4_indexer": logits,
        "sglang.srt.layers.attention.dsv4.v41_indexer.scoring": logits,
    }


def install() -> None:
    """Arm the V4.1 stand-ins in this process: each engine module is rebound when it is
    imported (or now, if it already is), one `[dsv41-cpu] dsv41 stand-ins in <module>: ...`
    line per module (the V4 stand-ins' mechanism: adapter.cpu.dsv4.arm)."""
    from adapter.cpu import dsv4

    dsv4.arm(_stand_ins(), "dsv41")
