"""Receipt lines: one per installed adapter, one per fallback reason (once), counters.

Records go to the logger "sglang.dsv41" (under the engine's "sglang" hierarchy). Adapters install
while the engine is still importing, before it configures logging, so until the root logger has a
handler our own stderr handler prints them; once the engine has configured logging, records
propagate to its handlers instead (never both).
"""
from __future__ import annotations

import collections
import logging
import sys

from adapter import metrics

LOGGER_NAME = "sglang.dsv41"
PREFIX = "[dsv41]"


class _UntilRootConfigured(logging.StreamHandler):
    def emit(self, record):
        if not logging.getLogger().handlers:
            super().emit(record)


def logger(adapter: str | None = None) -> logging.Logger:
    return logging.getLogger(LOGGER_NAME if adapter is None else f"{LOGGER_NAME}.{adapter}")


def _setup() -> None:
    base = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _UntilRootConfigured) for h in base.handlers):
        handler = _UntilRootConfigured(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        base.addHandler(handler)
    base.setLevel(logging.INFO)


_setup()

_seen_fallbacks: set[tuple[str, str]] = set()


class Counts(collections.Counter):
    """One adapter's counters: the one source of receipts and of the dsv41_* Prometheus series.

    Each increment is also handed to adapter/metrics.py, which exports it while the engine runs
    with --enable-metrics. Once metrics are known to be off in this process, every Counts goes
    back to a plain Counter (adapter/metrics.py), so nothing is left on the counting path.
    Copies (Counter.copy(), pickling) carry no adapter name and are not exported.
    """

    adapter: str | None = None

    def __setitem__(self, key, value):
        old = self.get(key, 0)
        super().__setitem__(key, value)
        if self.adapter is not None and value > old:
            metrics.counted(self.adapter, key, value - old)


class _ByAdapter(dict):
    def __missing__(self, adapter: str) -> collections.Counter:
        if metrics.off():
            counts = collections.Counter()
        else:
            counts = Counts()
            counts.adapter = adapter
        self[adapter] = counts
        return counts


counters: dict[str, collections.Counter] = _ByAdapter()


def installed(adapter: str, detail: str) -> None:
    logger(adapter).info("%s %s installed: %s", PREFIX, adapter, detail)


def fallback(adapter: str, reason: str) -> None:
    """Count every fallback; log the first of each distinct reason."""
    counters[adapter][f"fallback:{reason}"] += 1
    if (adapter, reason) not in _seen_fallbacks:
        _seen_fallbacks.add((adapter, reason))
        logger(adapter).info("%s %s fallback: %s (logged once)", PREFIX, adapter, reason)


def line(adapter: str, text: str, *args) -> None:
    """A receipt line an operator should see (plan/copy lines, periodic counts)."""
    logger(adapter).info(f"{PREFIX} {adapter} {text}", *args)


def warning(text: str, *args) -> None:
    logger().warning(f"{PREFIX} {text}", *args)


def forget(adapter: str) -> None:
    """Forget an adapter's counters and logged-once reasons (tests that count lines)."""
    counters[adapter].clear()
    for key in [k for k in _seen_fallbacks if k[0] == adapter]:
        _seen_fallbacks.discard(key)
