"""Stand-in for the engine's CPU refusal of fp8 KV, for the DeepSeek-V4 pool only.

CPU servers only (installed by adapter.cpu.dsv4.install); nothing in production imports this.
"""
from __future__ import annotations

import functools

MODULE = "sglang.srt.mem_cache.kv_cache_configurator"


def allow_v4_fp8_pool(configure):
    """Wraps KVCacheConfigurator.configure. On CPU, `configure` refuses fp8 KV unless the CPU
    has AMX and the backend is intel_amx: that is the check for the MHA pool's CPU fp8 kernels.
    The DeepSeek-V4 pool keeps fp8 as uint8 bytes (its 584-byte rows) and the SM120 torch sparse
    decode dequantises them in torch, so neither AMX nor intel_amx is used.
    In production (GB10, CUDA) the check never runs: the fp8 KV pool is native there.

    For a DeepSeek-V4 model, the check reads True for AMX and ("intel_amx",) for the backends.
    Both names are restored as soon as the check has read the backends (the first thing
    `configure` does), so the pool sizing and construction that follow see the real ones.
    Every other model keeps the engine's check unchanged."""
    import sys

    @functools.wraps(configure)
    def wrapper(self, *, pre_model_load_memory):
        module = sys.modules[MODULE]
        if not module.is_deepseek_v4(self.model_config.hf_config):
            return configure(self, pre_model_load_memory=pre_model_load_memory)
        saved = (module.cpu_has_amx_support, module.attention_backends)

        def backends_for_the_check():
            module.cpu_has_amx_support, module.attention_backends = saved
            return ("intel_amx",)

        module.cpu_has_amx_support = lambda: True
        module.attention_backends = backends_for_the_check
        try:
            return configure(self, pre_model_load_memory=pre_model_load_memory)
        finally:
            module.cpu_has_amx_support, module.attention_backends = saved

    wrapper.__dsv41_cpu_stand_in__ = True
    return wrapper


def install(module) -> bool:
    """Wrap `KVCacheConfigurator.configure` in `module` (once)."""
    cls = module.KVCacheConfigurator
    if getattr(cls.configure, "__dsv41_cpu_stand_in__", False):
        return False
    cls.configure = allow_v4_fp8_pool(cls.configure)
    return True
