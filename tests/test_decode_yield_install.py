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


MODEL_KEY = "DSV41_DECODE_YIELD_MODEL"


@pytest.mark.parametrize("raw, needle", [
    ("1,2,3", "expected 6 or 7 comma-separated integers"),
    ("20000,65000,277,60000,3000", "expected 6 or 7 comma-separated integers"),
    ("20000,65000,abc,60000,3000,52000", "CHUNK_PAIR_PS='abc' is not an integer"),
    ("20000,65000,277,0,3000,52000", "STEP_FIXED_US=0 out of range 1..60000000"),
    ("-1,65000,277,60000,3000,52000", "CHUNK_FIXED_US=-1 out of range"),
    ("20000,65000,277,60000,3000,52000,7,1", "expected 6 or 7 comma-separated integers"),
    ("20000,65000,277,60000,3000,52000,-7", "CHUNK_PREFIX_SQ_PS=-7 out of range"),
    ("", "expected 6 or 7 comma-separated integers"),
])
def test_bad_model_values_refuse_the_boot(raw, needle):
    with pytest.raises(keys.ConfigError, match=MODEL_KEY) as err:
        keys.parse_env({KEY: "33", MODEL_KEY: raw})
    assert needle in str(err.value)
    proc = run_python("print('booted')", env={KEY: "33", MODEL_KEY: raw})
    assert proc.returncode == 2
    assert "booted" not in proc.stdout
    assert MODEL_KEY in proc.stderr and needle in proc.stderr and "FATAL" in proc.stderr


def test_model_key_is_volatile_and_parses_to_the_six_constants():
    from adapter import decode_yield

    assert MODEL_KEY in keys.volatile_keys()
    parsed = keys.parse_env({KEY: "33", MODEL_KEY: " 0, 0,26766,1048 ,1388,576320"}).get(MODEL_KEY)
    assert parsed == (0, 0, 26766, 1048, 1388, 576320, 0)      # six values: no squared-prefix term
    seven = keys.parse_env({KEY: "33", MODEL_KEY: "0,0,26766,1048,1388,576320,13383"}).get(MODEL_KEY)
    assert seven == (0, 0, 26766, 1048, 1388, 576320, 13383)
    assert decode_yield.CostModel(*seven).value() == "0,0,26766,1048,1388,576320,13383"
    assert keys.parse_env({KEY: "33"}).get(MODEL_KEY) is None
    assert decode_yield.CLUSTER.value() == "20000,65000,277,60000,3000,52000"
    assert keys.parse_env({MODEL_KEY: decode_yield.CLUSTER.value()}).get(MODEL_KEY) == decode_yield.CLUSTER


@pytest.mark.parametrize("model, says", [
    (None, "cost model: cluster constants 20000,65000,277,60000,3000,52000 (DSV41_DECODE_YIELD_MODEL unset)"),
    ("0,0,26766,1048,1388,576320", "cost model: DSV41_DECODE_YIELD_MODEL=0,0,26766,1048,1388,576320 (fitted)"),
])
def test_installed_line_names_the_model_in_use(model, says):
    env = {KEY: "33", **({MODEL_KEY: model} if model else {})}
    proc = run_python(CHILD, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    receipt = [ln for ln in proc.stderr.splitlines() if "[dsv41] decode_yield installed:" in ln]
    assert len(receipt) == 1 and says in receipt[0], proc.stderr[-3000:]


def test_a_fitted_model_changes_the_plan_and_only_through_the_key():
    """The same pass and rows plan other steps under another model; the cluster model is the
    default of every cost function (the sim and the bench use it)."""
    from adapter import decode_yield as dy

    cpu = dy.CostModel(0, 0, 26766, 1048, 1388, 576320)
    cluster_pass, cpu_pass = dy.pass_cost_us([4096], [8192]), dy.pass_cost_us([4096], [8192], cpu)
    assert cluster_pass == dy.pass_cost_us([4096], [8192], dy.CLUSTER)
    assert cpu_pass == 4096 * (8192 + 2048) * 26766 // 1_000_000
    cluster_steps = dy.yield_steps(33, cluster_pass, dy.step_cost_us(2, 2000), 1)
    cpu_steps = dy.yield_steps(33, cpu_pass, dy.step_cost_us(2, 2000, cpu), 1)
    assert (cluster_steps, cpu_steps) == (3, 112)   # the CPU engine: a chunk is worth ~225 steps
