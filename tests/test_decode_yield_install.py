"""decode yield through the production paths (child processes): sitecustomize, `dsv41 check`, bad keys.

The children run with PYTHONPATH=<repo root> and only the given environment, so sitecustomize.py
arms the installer exactly as in the image; each child installs the torchvision stand-in
(adapter/cpu/cpu_engine.py) before its first engine import, as the CPU harness must.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapter import keys
from conftest import REPO_ROOT, run_python

KEY = "DSV41_DECODE_YIELD"
ROWS = ("get_next_batch_to_run", "_should_defer_prefill", "_arm_prefill_decode_interval")

CHILD = """
import json
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
import sglang.srt.managers.scheduler as sched
from adapter import installer
cls = sched.Scheduler
print(json.dumps({
    "files": {n: cls.__dict__[n].__code__.co_filename.rsplit("/", 1)[-1] for n in %r},
    "inner": {n: getattr(cls.__dict__[n], "__wrapped__", cls.__dict__[n]).__qualname__
              for n in %r},
    "state": installer.status()["decode_yield"].status,
    "detail": installer.status()["decode_yield"].detail,
}))
""" % (ROWS, ROWS)


def test_sitecustomize_installs_on_scheduler_import():
    proc = run_python(CHILD, env={KEY: "33"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["state"] == "installed"
    # each row is now the HookRegistry's wrapper around the engine's own method
    assert set(out["files"].values()) == {"hook_registry.py"}
    assert out["inner"]["_should_defer_prefill"] == "Scheduler._should_defer_prefill"
    assert out["inner"]["_arm_prefill_decode_interval"] == "Scheduler._arm_prefill_decode_interval"
    receipt = [ln for ln in proc.stderr.splitlines() if "[dsv41] decode_yield installed:" in ln]
    assert len(receipt) == 1 and "DSV41_DECODE_YIELD=33" in receipt[0], proc.stderr[-3000:]


@pytest.mark.parametrize("raw", ["0", "100", "-3", "abc", "33.5", "33%", ""])
def test_bad_values_refuse_the_boot(raw):
    with pytest.raises(keys.ConfigError, match=KEY):
        keys.parse_env({KEY: raw})
    proc = run_python("print('booted')", env={KEY: raw})
    assert proc.returncode == 2
    assert "booted" not in proc.stdout
    assert KEY in proc.stderr and "FATAL" in proc.stderr


@pytest.mark.parametrize("raw,value", [("1", 1), ("33", 33), (" 50 ", 50), ("99", 99)])
def test_good_values_parse(raw, value):
    assert keys.parse_env({KEY: raw}).get(KEY) == value
    assert keys.parse_env({KEY: raw}).enabled("decode_yield")


def test_dsv41_check_installs_a_yield_line(tmp_path):
    profile = tmp_path / "yield.env"
    profile.write_text(f'EXTRA_CONTAINER_ENV="{KEY}=33"\n'
                       'EXTRA_SGLANG_ARGS="--page-size 256 --chunked-prefill-size 8192 '
                       '--prefill-decode-interval 1"\n')
    proc = subprocess.run([sys.executable, "-m", "adapter.tools.cli", "check", "--profile", str(profile),
                           "--line", "production", "--json"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["adapter"]: r for r in json.loads(proc.stdout)}
    row = rows["decode_yield"]
    assert row["installed"] and row["pin_ok"] and row["keys"] == {KEY: "33"}
    assert all(not r["enabled"] for name, r in rows.items() if name != "decode_yield")
