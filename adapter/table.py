"""THE table: which engine callable each adapter wraps, and which keys turn it on.

One row per wrapped callable: (adapter, engine module, qualname). Rows of one callable are
applied in table order, the first row innermost: an adapter further down the table wraps the
result of the ones above it. Adapters that share a callable are installed together in one pass,
so that order holds whichever engine module a process imports first.
The keys of each adapter live in adapter/keys.py (the key registry).
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Hook:
    adapter: str      # adapter name == module adapter/<name>.py
    module: str       # engine module that defines the callable
    qualname: str     # "Class.method" or "function"

    @property
    def target(self) -> str:
        """Dotted path in HookRegistry's form."""
        return f"{self.module}.{self.qualname}"

    @property
    def pin_id(self) -> str:
        return f"{self.module}:{self.qualname}"


_SCHED = "sglang.srt.managers.scheduler"
_POLICY = "sglang.srt.managers.schedule_policy"
_URC = "sglang.srt.mem_cache.unified_radix_cache"
_TREE_CORES = "sglang.srt.mem_cache.unified_cache.tree_core_registry"
_SM120 = "sglang.kernels.ops.attention.flash_mla_sm120"
_AUTOTUNE = "sglang.srt.model_executor.runner.flashinfer_autotune"

HOOKS: tuple[Hook, ...] = (
    # swan: SM12x sparse decode reads 256-token SWA pages in place (the SM12x decode entry;
    # calls it cannot serve go to the stock function, which keeps _split_kv_pages_to_64).
    Hook("swan", _SM120, "flash_mla_with_kvcache_sm120"),
    # decode yield: defer the next chunk of a chunked prefill through the engine's own path.
    Hook("decode_yield", _SCHED, "Scheduler.get_next_batch_to_run"),
    Hook("decode_yield", _SCHED, "Scheduler._should_defer_prefill"),
    Hook("decode_yield", _SCHED, "Scheduler._arm_prefill_decode_interval"),
    # swa_thin (before swa_cone): moved-past checkpoints to the SWA LRU's evict-first end; with
    # the key set the engine's backend selection picks the Python tree core (Rust has no LRU API).
    Hook("swa_thin", _URC, "UnifiedRadixCache.checkpoint_into_tree"),
    Hook("swa_thin", _TREE_CORES, "select_tree_core_backend"),
    # swa_cone: re-match on full KV and plan a one-chunk replay in the PrefillAdder path; the
    # first pass copies the resident latents / index keys, masks the replay rows' writes, floors
    # their window (forward side, DSV4 attention backend).
    Hook("swa_cone", _URC, "UnifiedRadixCache.match_prefix"),
    Hook("swa_cone", _POLICY, "PrefillAdder.add_one_req"),
    Hook("swa_cone", _POLICY, "PrefillAdder._select_prefill_admission"),
    Hook("swa_cone", "sglang.srt.layers.attention.deepseek_v4_backend",
         "DeepseekV4AttnBackend._build_forward_metadata"),
    Hook("swa_cone", "sglang.srt.layers.attention.deepseek_v4_backend",
         "DeepseekV4AttnBackend.init_forward_metadata_prefill"),
    # autotune_keep: rank agreement on loadability; launch sidecar.
    Hook("autotune_keep", _AUTOTUNE, "_autotune_cache_digest"),
    Hook("autotune_keep", _AUTOTUNE, "_drop_diverged_autotune_cache"),
    Hook("autotune_keep", _AUTOTUNE, "flashinfer_autotune_context"),
)

ADAPTERS: tuple[str, ...] = tuple(dict.fromkeys(h.adapter for h in HOOKS))


def hooks_of(adapter: str) -> tuple[Hook, ...]:
    return tuple(h for h in HOOKS if h.adapter == adapter)


def modules_of(adapter: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(h.module for h in hooks_of(adapter)))


def _targets(adapters) -> set[str]:
    return {h.target for a in adapters for h in hooks_of(a)}


def install_groups(enabled) -> list[tuple[str, ...]]:
    """Enabled adapters joined when they share a callable; groups and members in table order."""
    groups: list[set[str]] = []
    for name in (a for a in ADAPTERS if a in enabled):
        overlapping = [g for g in groups if _targets(g) & _targets({name})]
        merged = {name}.union(*overlapping)
        groups = [g for g in groups if g not in overlapping] + [merged]
    order = ADAPTERS.index
    return sorted((tuple(sorted(g, key=order)) for g in groups), key=lambda g: order(g[0]))
