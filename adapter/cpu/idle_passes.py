"""CPU harness, tests only: a log line for each idle pass of the scheduler after work.

DSV41CPU_LOG_IDLE_PASSES=1 (set through CpuServer's extra_env) wraps `Scheduler.on_idle` so that
each time the scheduler turns fully idle after having had work, once the engine's idle pass has
returned (its strict memory and tree checks, `SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE`, raise
on a leak there), it writes "[dsv41-cpu] idle pass <n>: the engine's idle checks ran". A test then
waits for that line instead of sleeping and hoping the pass ran (tests/e2e/test_e2e_faults.py).
Production never imports this module: only the CPU harness's sitecustomize applies it.
"""
from __future__ import annotations

import functools
import sys

ENV = "DSV41CPU_LOG_IDLE_PASSES"
MODULE = "sglang.srt.managers.scheduler"
LINE = "[dsv41-cpu] idle pass {n}: the engine's idle checks ran"
_MARK = "__dsv41_cpu_idle_passes__"


def apply(module=None) -> None:
    """Wrap Scheduler.on_idle (idempotent)."""
    module = module or sys.modules[MODULE]
    original = module.Scheduler.on_idle
    if getattr(original, _MARK, False):
        return
    # the engine's forward count at the last idle pass logged: work ran since when it moved
    state = {"passes": 0, "checked_at": 0}

    @functools.wraps(original)
    def on_idle(self, *args, **kwargs):
        idle = self.is_fully_idle()
        result = original(self, *args, **kwargs)
        if idle and self.forward_ct != state["checked_at"]:
            state["checked_at"] = self.forward_ct
            state["passes"] += 1
            sys.stderr.write(LINE.format(n=state["passes"]) + "\n")
            sys.stderr.flush()
        return result

    setattr(on_idle, _MARK, True)
    module.Scheduler.on_idle = on_idle
