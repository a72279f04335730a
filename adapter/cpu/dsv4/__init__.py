"""CPU stand-ins for what the engine's DeepSeek-V4 forward runs on GPUs (Triton, CUDA-JIT,
TileLang), one function each, grouped by the engine module they stand in for:

    attention.py   the attention backend's metadata pieces and the V4 KV stores (cone's harness)
    flash_mla.py   flash_mla_sm120's Triton page split kernels (`_page_mark_kernel`,
                   `_page_split_kernel`) and FlashInfer's `_sparse_mla_sm120_paged_attention`
                   (the stock SM12x decode route, SGLANG_SM120_FLASHMLA_BACKEND=flashinfer)
    metadata.py    deepseek_v4_backend._init_compression_metadata_triton
    compressor.py  compressor_v2.create_paged_compressor_data, compress.compress_forward,
                   compress.compress_norm_rope_store
    norm_rope.py   norm_rope.fused_* (q / k / kv norm + rope, indexer q quant), get_rope_wrapper
    mhc.py         mhc.hc_split_sinkhorn, mhc.mhc_combine, mhc_head.fused_hc_head
    kv_pool.py     kv_cache_configurator.KVCacheConfigurator.configure's CPU fp8 refusal

Tests, benches and CPU test servers only: `install()` runs from the CPU harness sitecustomize
(adapter/cpu/site/) when DSV41CPU_DSV4=1, which adapter/cpu/server.py sets for model="dsv4".
Nothing in production imports this package. See docs/cpu_server.md for the full list.
"""
from __future__ import annotations

import sys

# The engine's GB10 route and torch paths (SPEC "A whole DeepSeek-V4 in the real server on CPU").
# The SM120 sparse attention takes production's backend, flashinfer: the engine's own entry, its
# 256 -> 4 x 64-token page split and its FlashInfer call, with the Triton split kernels and
# FlashInfer's entry stood in (flash_mla.py; the decode itself is the engine's torch
# `_sm120_sparse_decode_fwd`, what the `torch` backend would run on the unsplit pages).
ENGINE_ENV = {
    "SGLANG_SM120_FLASHMLA_BACKEND": "flashinfer",
    "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH": "1",
    # On SM120 the engine turns the TileLang indexer logits on unless this is set (model_hook.py);
    # off, the indexer takes the torch fp8_paged_mqa_logits_torch_sm120.
    "SGLANG_OPT_USE_TILELANG_INDEXER": "0",
    "SGLANG_OPT_FUSE_MHC_POST_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_PRE": "0",
    "SGLANG_OPT_USE_TILELANG_MHC_POST": "0",
    "SGLANG_OPT_DEEPGEMM_HC_PRENORM": "0",
    "SGLANG_OPT_USE_FUSED_HASH_TOPK": "0",
}


def _stand_ins() -> dict:
    """{engine module: {name: stand-in}}: the defining modules and every module that binds the
    name with `from ... import` (rebinding only where the engine's original is bound)."""
    from adapter.cpu.dsv4 import compressor, flash_mla, metadata, mhc, norm_rope

    rope = {"fused_rope_inplace": norm_rope.fused_rope_inplace,
            "fused_norm_rope_inplace": norm_rope.fused_norm_rope_inplace,
            "fused_q_norm_rope": norm_rope.fused_q_norm_rope,
            "fused_q_indexer_rope_hadamard_quant": norm_rope.fused_q_indexer_rope_hadamard_quant,
            "fused_k_norm_rope_flashmla": norm_rope.fused_k_norm_rope_flashmla}
    compress = {"compress_forward": compressor.compress_forward,
                "compress_norm_rope_store": compressor.compress_norm_rope_store}
    plan = {"create_paged_compressor_data": compressor.create_paged_compressor_data}
    mhc_ops = {"hc_split_sinkhorn": mhc.hc_split_sinkhorn, "mhc_combine": mhc.mhc_combine}
    return {
        "sglang.kernels.ops.attention.dsv4.norm_rope": rope,
        "sglang.kernels.ops.attention.dsv4": {**rope, **compress},
        "sglang.kernels.ops.attention.dsv4.compress": compress,
        "sglang.kernels.ops.layernorm.mhc": mhc_ops,
        "sglang.kernels.ops.layernorm.mhc_head": {"fused_hc_head": mhc.fused_hc_head},
        "sglang.srt.layers.rotary_embedding": {"get_rope_wrapper": norm_rope.get_rope_wrapper},
        "sglang.srt.layers.attention.dsv4.compressor_v2": {**compress, **plan},
        "sglang.srt.layers.attention.dsv4.indexer": rope,
        "sglang.srt.mem_cache.deepseek_v4_memory_pool": rope,
        "sglang.srt.models.deepseek_v4": {**rope, **mhc_ops,
                                          "get_rope_wrapper": norm_rope.get_rope_wrapper},
        "sglang.srt.models.deepseek_v4_mhc": mhc_ops,
        "sglang.srt.layers.attention.deepseek_v4_backend": {
            **plan, "_init_compression_metadata_triton": metadata.init_compression_metadata_torch},
        flash_mla.ENGINE_MODULE: {"_page_mark_kernel": flash_mla.page_mark_kernel,
                                  "_page_split_kernel": flash_mla.page_split_kernel},
    }


def _rebind(module, names: dict) -> list:
    """Replace the module's bindings of `names` with the stand-ins; returns what it replaced."""
    from adapter.cpu.dsv4 import norm_rope

    done = []
    for name, stand_in in names.items():
        current = module.__dict__.get(name)
        if current is None or current is stand_in:
            continue
        if name == "get_rope_wrapper" and norm_rope._ENGINE_GET_ROPE_WRAPPER is None:
            norm_rope._ENGINE_GET_ROPE_WRAPPER = current
        setattr(module, name, stand_in)
        done.append(name)
    return done


def arm(stand_ins: dict, label: str) -> None:
    """Rebind each engine module's names to the stand-ins when it is imported (or now, if it
    already is), one `[dsv41-cpu] <label> stand-ins in <module>: ...` line per module rebound.
    Shared by the V4 stand-ins here and the V4.1 ones (adapter/cpu/dsv41/)."""
    import wrapt

    for target, names in stand_ins.items():
        def hook(module, names=names):
            done = _rebind(module, names)
            if done:
                sys.stderr.write(f"[dsv41-cpu] {label} stand-ins in {module.__name__}: "
                                 f"{', '.join(sorted(done))}\n")
        wrapt.register_post_import_hook(hook, target)


def install() -> None:
    """Arm the stand-ins in this process: each engine module is rebound when it is imported
    (or now, if it already is), and the platform probe answers GB10 (SM120)."""
    import wrapt

    arm(_stand_ins(), "dsv4")
    wrapt.register_post_import_hook(_sm120, "sglang.srt.runtime_context")
    wrapt.register_post_import_hook(_flashinfer, "sglang.kernels.ops.attention.flash_mla_sm120")
    wrapt.register_post_import_hook(_kv_pool, "sglang.srt.mem_cache.kv_cache_configurator")


def _kv_pool(module) -> None:
    """The CPU fp8-KV refusal, lifted for the DeepSeek-V4 pool (adapter.cpu.dsv4.kv_pool)."""
    from adapter.cpu.dsv4 import kv_pool

    if kv_pool.install(module):
        sys.stderr.write(f"[dsv41-cpu] dsv4 stand-in in {module.__name__}: "
                         "KVCacheConfigurator.configure (CPU fp8 KV refusal, V4 pool only)\n")


def _flashinfer(module) -> None:
    """FlashInfer's SM120 sparse MLA entry, which the engine imports at call time and which
    cannot import on CPU: answered by the stand-in module (adapter.cpu.dsv4.flash_mla)."""
    from adapter.cpu.dsv4 import flash_mla

    if flash_mla.install_flashinfer():
        sys.stderr.write(f"[dsv41-cpu] dsv4 stand-in for {module.__name__}: "
                         f"{flash_mla.FLASHINFER_MODULE}._sparse_mla_sm120_paged_attention "
                         "(the engine's torch sparse decode on the pages it is given)\n")


def _sm120(module) -> None:
    """The GB10 probe (production: the device's compute capability 12.x): the platform this
    process reports says is_sm120, so the backend takes the SM120 route (torch sparse decode)."""
    from adapter.cpu.dsv4.attention import force_sm120

    force_sm120(module)
