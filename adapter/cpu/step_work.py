"""CPU harness, tests only: a planted speed regression for `dsv41 gate` (tests/e2e/test_e2e_gate.py).

DSV41CPU_STEP_EXTRA_WORK=<factor> (set through CpuServer's extra_env) makes the scheduler, after
each batch it runs (`Scheduler.run_batch`: every prefill and every decode step; synchronous on CPU,
where the engine turns the overlap schedule off), keep its thread busy for `factor` times the CPU
time that batch took. The regression is extra work proportional to the step it slows, not a fixed
sleep: on a loaded machine the step and its extra work slow alike, so the candidate's speed over
the controls' stays where it is on an idle one (a fixed sleep does not slow down with the machine,
and the planted candidate's ratio drifted up toward the KILL line under load: issue 40). Outputs
stay the same. Production never imports this module: only the CPU harness's sitecustomize
(adapter/cpu/site/) applies it, and only when the variable is set.
"""
from __future__ import annotations

import functools
import os
import sys
import time

ENV = "DSV41CPU_STEP_EXTRA_WORK"
MODULE = "sglang.srt.managers.scheduler"
_MARK = "__dsv41_cpu_step_work__"


def factor() -> float:
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a factor of the step's CPU time (a number >= 0)") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{ENV}={raw!r}: expected a factor of the step's CPU time (a number >= 0)")
    return value


def burn(cpu_s: float, clock=time.thread_time) -> None:
    """Keep this thread on the CPU until its CPU clock has advanced by cpu_s."""
    until = clock() + cpu_s
    while clock() < until:
        pass


def apply(module=None) -> None:
    """Wrap Scheduler.run_batch with the proportional extra work (idempotent)."""
    module = module or sys.modules[MODULE]
    original = module.Scheduler.run_batch
    if getattr(original, _MARK, False):
        return
    extra = factor()

    @functools.wraps(original)
    def run_batch(self, *args, **kwargs):
        began = time.thread_time()
        try:
            return original(self, *args, **kwargs)
        finally:
            burn(extra * (time.thread_time() - began))

    setattr(run_batch, _MARK, True)
    module.Scheduler.run_batch = run_batch
    sys.stderr.write(f"[dsv41-cpu] step extra work armed: after each Scheduler.run_batch the scheduler "
                     f"thread works {extra:g} x the batch's CPU time\n")
