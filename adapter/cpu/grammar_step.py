"""CPU harness, tests only: a planted slow grammar step for the input guard's grammar step bound.

DSV41CPU_GRAMMAR_STEP_MS=<ms> (set through CpuServer's extra_env) makes every call of xgrammar's
`GrammarMatcher.accept_token` (the engine's XGrammarGrammar.accept_token calls it once per decode
step of a grammar request) sleep <ms> milliseconds before the real call. A sleep lasts at least
its time, so each grammar step the guard times takes at least <ms> ms on any machine: a test that
sets the bound (DSV41_INPUT_GUARD_GRAMMAR_STEP_MS) below it sees the bound act whatever the
machine's speed (tests/e2e/test_e2e_tp2.py), where a real grammar's step is faster than the bound
on a fast machine. The planted cost sits inside the engine callable the guard wraps and times,
below it: the engine's own XGrammarGrammar is not altered (its pin stays the stock one). Outputs
stay the same. Production never imports this module: only the CPU harness's sitecustomize
(adapter/cpu/site/) applies it, and only when the variable is set.
"""
from __future__ import annotations

import functools
import os
import sys
import time

ENV = "DSV41CPU_GRAMMAR_STEP_MS"
MODULE = "xgrammar.matcher"
_MARK = "__dsv41_cpu_grammar_step__"


def step_ms() -> float:
    raw = os.environ.get(ENV, "")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ValueError(f"{ENV}={raw!r}: expected the planted grammar step in milliseconds (> 0)")
    return value


def apply(module=None, sleep=time.sleep) -> None:
    """Wrap GrammarMatcher.accept_token with the planted sleep (idempotent)."""
    module = module or sys.modules[MODULE]
    original = module.GrammarMatcher.accept_token
    if getattr(original, _MARK, False):
        return
    seconds = step_ms() / 1000

    @functools.wraps(original)
    def accept_token(self, *args, **kwargs):
        sleep(seconds)
        return original(self, *args, **kwargs)

    setattr(accept_token, _MARK, True)
    module.GrammarMatcher.accept_token = accept_token
    sys.stderr.write(f"[dsv41-cpu] planted grammar step armed: each GrammarMatcher.accept_token "
                     f"sleeps {seconds * 1000:g} ms first\n")
