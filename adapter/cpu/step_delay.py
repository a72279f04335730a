"""CPU harness, tests only: a planted speed regression for `dsv41 gate` (tests/e2e/test_e2e_gate.py).

DSV41CPU_STEP_DELAY_MS=<ms> (set through CpuServer's extra_env) makes the scheduler sleep that long
before each batch it runs (`Scheduler.run_batch`: every prefill and every decode step), so tokens/s
drops several-fold and outputs stay the same. Production never imports this module: only the CPU
harness's sitecustomize (adapter/cpu/site/) applies it, and only when the variable is set.
"""
from __future__ import annotations

import functools
import os
import sys
import time

ENV = "DSV41CPU_STEP_DELAY_MS"
MODULE = "sglang.srt.managers.scheduler"
_MARK = "__dsv41_cpu_step_delay__"


def delay_s() -> float:
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected milliseconds (a number >= 0)") from None
    if value < 0:
        raise ValueError(f"{ENV}={raw!r}: expected milliseconds (a number >= 0)")
    return value / 1000.0


def apply(module=None) -> None:
    """Wrap Scheduler.run_batch with a sleep (idempotent)."""
    module = module or sys.modules[MODULE]
    original = module.Scheduler.run_batch
    if getattr(original, _MARK, False):
        return
    pause = delay_s()

    @functools.wraps(original)
    def run_batch(self, *args, **kwargs):
        time.sleep(pause)
        return original(self, *args, **kwargs)

    setattr(run_batch, _MARK, True)
    module.Scheduler.run_batch = run_batch
    sys.stderr.write(f"[dsv41-cpu] step delay armed: Scheduler.run_batch sleeps {pause * 1000:g} ms per batch\n")
