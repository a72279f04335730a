"""CPU harness only: fix an engine bug in the torch_native attention backend (sglang 0.5.23).

The bug (docs/upstream_torch_native_swa.md): with a hybrid sliding-window model the KV pool is a
SWAKVPool whose sliding-window layers live in a smaller buffer with their own slot numbers. The
torch_native backend *writes* those layers through the full->SWA translation (KVWriteLoc with
`swa_out_cache_loc`), but `_run_sdpa_forward_extend` / `_run_sdpa_forward_decode` *read* them with
`k_cache[req_to_token[...]]`, i.e. with full-pool slot numbers. Below the SWA pool size that reads
other requests' slots (wrong outputs, silently); past it the scheduler dies with an IndexError.

The fix translates `req_to_token` through the pool's `full_to_swa_index_mapping` when the buffer
being read is a SWA layer's, as the GPU backends do. Production never uses torch_native and never
imports this module: only the CPU harness's sitecustomize (adapter/cpu/site/) applies it.
"""
from __future__ import annotations

import functools
import inspect
import logging

MODULE = "sglang.srt.layers.attention.torch_native_backend"
CLASS = "TorchNativeAttnBackend"
METHODS = ("_run_sdpa_forward_extend", "_run_sdpa_forward_decode")
_MARK = "__dsv41_cpu_fix__"


def _swa_buffers(backend) -> list:
    pool = backend.token_to_kv_pool
    swa = getattr(pool, "swa_kv_pool", None)
    if not getattr(backend, "use_sliding_window_kv_pool", False) or swa is None:
        return []
    return list(getattr(swa, "k_buffer", ())) + list(getattr(swa, "v_buffer", ()))


def _fixed(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def run_sdpa(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        k_cache = bound.arguments["k_cache"]
        if any(k_cache is buf for buf in _swa_buffers(self)):
            mapping = self.token_to_kv_pool.full_to_swa_index_mapping
            bound.arguments["req_to_token"] = mapping[bound.arguments["req_to_token"].long()]
        return original(*bound.args, **bound.kwargs)

    setattr(run_sdpa, _MARK, original)
    return run_sdpa


def apply(backend_cls=None) -> bool:
    """Patch the class (idempotent). Returns True when this call patched it."""
    if backend_cls is None:
        import importlib

        backend_cls = getattr(importlib.import_module(MODULE), CLASS)
    changed = False
    for name in METHODS:
        current = backend_cls.__dict__[name]
        if getattr(current, _MARK, None) is None:
            setattr(backend_cls, name, _fixed(current))
            changed = True
    if changed:
        logging.getLogger("sglang.dsv41.cpu").warning(
            "[dsv41-cpu] harness fix applied: torch_native SWA layers read through "
            "full_to_swa_index_mapping (engine bug, CPU harness only; docs/upstream_torch_native_swa.md)")
    return changed


def remove(backend_cls) -> None:
    """Restore the engine's methods (tests that show the bug)."""
    for name in METHODS:
        original = getattr(backend_cls.__dict__[name], _MARK, None)
        if original is not None:
            setattr(backend_cls, name, original)
