"""Receipt lines reach a plain server log exactly once, before and after the engine sets up logging."""
from conftest import run_python

CHILD = r"""
import logging
from adapter import receipts
receipts.installed("swa_thin", "before logging is configured")
receipts.fallback("swan", "reason A")
receipts.fallback("swan", "reason A")
receipts.fallback("swan", "reason B")
# What the engine's configure_logger() does in every process:
logging.basicConfig(level=logging.WARNING, format="[engine] %(message)s", force=True)
receipts.installed("decode_yield", "after logging is configured")
print(dict(receipts.counters["swan"]))
"""


def test_receipts_once_each_and_fallbacks_logged_once_per_reason():
    proc = run_python(CHILD)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines.count("[dsv41] swa_thin installed: before logging is configured") == 1
    # after the engine's basicConfig, the record goes through the engine's handler, once,
    # even though the engine's root level is WARNING
    assert lines.count("[engine] [dsv41] decode_yield installed: after logging is configured") == 1
    assert not any(ln == "[dsv41] decode_yield installed: after logging is configured" for ln in lines)
    assert sum("reason A" in ln for ln in lines) == 1 and sum("reason B" in ln for ln in lines) == 1
    assert "{'fallback:reason A': 2, 'fallback:reason B': 1}" in proc.stdout
