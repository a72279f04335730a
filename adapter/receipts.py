"""Receipt lines: one per installed adapter, one per fallback reason (once), counters.

Records go to the logger "sglang.dsv41" (under the engine's "sglang" hierarchy). Adapters install
while the engine is still importing, before it configures logging, so until the root logger has a
handler our own stderr handler prints them; once the engine has configured logging, records
propagate to its handlers instead (never both).

A leaf module: it imports nothing of ours. adapter/metrics.py reads the counters from here and
registers itself as a sink while it exports.
"""
from __future__ import annotations

import collections
import logging
import sys

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


_sinks: list = []       # callables (adapter, key, delta): metrics registers one while exporting


def add_sink(sink) -> None:
    """Hand every later increment of every adapter's counters to `sink(adapter, key, delta)`.
    A sink must not raise (metrics catches its own errors)."""
    if sink not in _sinks:
        _sinks.append(sink)


def remove_sink(sink) -> None:
    if sink in _sinks:
        _sinks.remove(sink)


_install_sinks: list = []   # callables (adapter): metrics, for adapters installed after it started


def add_install_sink(sink) -> None:
    if sink not in _install_sinks:
        _install_sinks.append(sink)


def remove_install_sink(sink) -> None:
    if sink in _install_sinks:
        _install_sinks.remove(sink)


class Counts(collections.Counter):
    """One adapter's counters: the one source of receipt lines and of the dsv41_* series.

    With no sink registered (metrics off or not settled yet) an increment costs one list check
    more than a plain Counter. Copies (Counter.copy(), pickling) carry no adapter name and are
    not handed on.
    """

    adapter: str | None = None

    def __setitem__(self, key, value, _set=dict.__setitem__):
        # dict's own __setitem__ bound as a default: no super() lookup on the hot path (swan's
        # router counts every served call).
        if _sinks and self.adapter is not None:
            delta = value - self.get(key, 0)
            _set(self, key, value)
            if delta > 0:
                for sink in _sinks:
                    sink(self.adapter, key, delta)
        else:
            _set(self, key, value)


class _ByAdapter(dict):
    def __missing__(self, adapter: str) -> Counts:
        counts = self[adapter] = Counts()
        counts.adapter = adapter
        return counts


counters: dict[str, Counts] = _ByAdapter()


def installed(adapter: str, detail: str) -> None:
    logger(adapter).info("%s %s installed: %s", PREFIX, adapter, detail)
    for sink in list(_install_sinks):
        sink(adapter)


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
