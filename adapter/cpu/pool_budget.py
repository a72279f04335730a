"""CPU harness, benches only: let the engine's own pool sizing split a fixed KV budget on the tiny
DeepSeek-V4, as it does on the cluster's V4.1 (bench/agent_traffic.py --lines, issue 43).

Two switches (set through CpuServer's extra_env), each applied where its engine module imports:

  DSV41CPU_FREE_MEMORY_MB=<MB>  the free memory the engine profiles on this CPU, fixed
      (`sglang.srt.utils.common.get_free_cpu_memory`). On a GPU the KV budget is what the weights
      leave of the device; on CPU the engine reads the machine's available memory, which moves
      with every other process on a shared machine and is gigabytes here, so no pool is ever
      short of bytes and `--swa-prefix-tails` trades nothing. With a fixed figure F the budget is
      F x --mem-fraction-static (the engine charges the slack F x (1 - fraction); the weights'
      bytes are not seen), the same on every boot.
  DSV41CPU_DSV4_CAP_SIZING=1    the V4.1 checkpoint's SWA sizing on the tiny V4 model: the engine's
      DeepSeek-V4 override (`sglang.srt.arg_groups.model_overrides.deepseek_v4`) sets
      --swa-full-tokens-ratio 0.1 for every model_type but "deepseek_v41"; the tiny model is
      "deepseek_v4" (changing its model_type moves 44 code paths of the engine). The switch drops
      that one default from the override's answer, so with no operator ratio the pool configurator
      runs its cap mode (`_resolve_swa_cap_tokens`: request cap + tails x (window + page)) as it
      does for the cluster's checkpoint. An operator's own --swa-full-tokens-ratio is untouched.

Production never imports this module: only the CPU harness's sitecustomize applies it.
"""
from __future__ import annotations

import os
import sys

FREE_MEMORY_ENV = "DSV41CPU_FREE_MEMORY_MB"
CAP_SIZING_ENV = "DSV41CPU_DSV4_CAP_SIZING"
MEMORY_MODULE = "sglang.srt.utils.common"
OVERRIDE_MODULE = "sglang.srt.arg_groups.model_overrides.deepseek_v4"
OVERRIDE_REGISTRY = "sglang.srt.arg_groups.model_override_base"
ARCHITECTURE = "DeepseekV4ForCausalLM"
_MARK = "__dsv41_cpu_pool_budget__"


def free_memory_bytes() -> int:
    raw = os.environ.get(FREE_MEMORY_ENV, "")
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0 or mb == float("inf"):
        raise ValueError(f"{FREE_MEMORY_ENV}={raw!r}: expected the free memory in MB (a number > 0)")
    return int(mb * (1 << 20))


def apply_free_memory(module=None) -> None:
    """Replace get_free_cpu_memory in the engine's utils (idempotent). get_available_gpu_memory
    looks the name up in its own module at each call, so this is the one place to change."""
    module = module or sys.modules[MEMORY_MODULE]
    if getattr(module.get_free_cpu_memory, _MARK, False):
        return
    value = free_memory_bytes()

    def get_free_cpu_memory() -> int:
        return value

    setattr(get_free_cpu_memory, _MARK, True)
    module.get_free_cpu_memory = get_free_cpu_memory
    sys.stderr.write(f"[dsv41-cpu] pool budget: free memory fixed at {value >> 20} MB\n")


def without_ratio_default(fn):
    """The override provider `fn`, minus the swa_full_tokens_ratio default it declares when the
    operator gave none (an operator's ratio is not declared by the override, so it stays)."""
    def provider(server_args, hf_config):
        declared = dict(fn(server_args, hf_config))
        declared.pop("swa_full_tokens_ratio", None)
        return declared

    provider.__qualname__ = getattr(fn, "__qualname__", "provider")
    setattr(provider, _MARK, True)
    return provider


def apply_cap_sizing(module=None) -> None:
    """Wrap the DeepSeek-V4 override provider in the engine's registry (idempotent)."""
    module = module or sys.modules[OVERRIDE_MODULE]
    registry = sys.modules[OVERRIDE_REGISTRY]._MODEL_OVERRIDE_FNS
    fns = registry.get(ARCHITECTURE, [])
    target = module._deepseek_v4_overrides
    for i, fn in enumerate(fns):
        if fn is target:
            fns[i] = without_ratio_default(fn)
            sys.stderr.write("[dsv41-cpu] pool budget: DeepSeek-V4 SWA pool sized by the engine's cap mode "
                             "(the override's swa_full_tokens_ratio 0.1 default dropped)\n")
