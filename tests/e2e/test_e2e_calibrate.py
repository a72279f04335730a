"""Decode yield calibrated on the real CPU server (issue 15).

Two boots of the dense tiny model with DSV41_DECODE_YIELD=33 and the production line's CPU
launch args:
1. the cluster constants (DSV41_DECODE_YIELD_MODEL unset): the yield scenario (two streams, a
   24,576-token prompt in 4,096-token chunks; the streams' rate during the prefill over their
   rate before it, from streamed token timestamps), then traffic.calibration_run; its scheduler
   log goes through `dsv41 calibrate yield`;
2. the fitted model (DSV41_DECODE_YIELD_MODEL=<the printed value>): the yield scenario again.
The achieved share must land closer to 0.33 with the fit than with the cluster constants.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapter.cpu.server import CpuServer
from adapter.tools import canary, traffic

from .e2e_configs import PROD_ARGS, REPO_ROOT

SHARE = 33
KEYS = {"DSV41_DECODE_YIELD": str(SHARE)}
PREFILL = canary.CADENCE_PREFILL["dense"]


def _args():
    args = dict(canary.MODEL_ARGS["dense"])
    args.update(PROD_ARGS)
    return args


def _scheduler_log(server: CpuServer):
    pids = [pid for pid, role in server.roles.items() if role.startswith("sglang::scheduler")]
    assert len(pids) == 1, server.roles
    return server.log_dir / f"{pids[0]}.log"


def _yield_lines(server: CpuServer, what: str) -> list[str]:
    return [ln for ln in server.log().splitlines() if f"[dsv41] decode_yield {what}" in ln]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    out = {}
    with CpuServer("dense", keys=KEYS, args=_args(), name="calibrate-cluster",
                   log_dir=tmp_path_factory.mktemp("cal-cluster")) as server:
        out["cluster"] = traffic.yield_cadence(server, PREFILL)
        out["sent"] = traffic.calibration_run(server)
        out["cluster_installed"] = _yield_lines(server, "installed")
        out["cluster_yielded"] = _yield_lines(server, "rid=")
        log = _scheduler_log(server)
    proc = subprocess.run([sys.executable, "-m", "adapter.tools.cli", "calibrate", "yield",
                           "--log", str(log), "--json"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out["fit"] = json.loads(proc.stdout)
    fitted_keys = dict(KEYS, DSV41_DECODE_YIELD_MODEL=out["fit"]["value"])
    with CpuServer("dense", keys=fitted_keys, args=_args(), name="calibrate-fitted",
                   log_dir=tmp_path_factory.mktemp("cal-fitted")) as server:
        out["fitted"] = traffic.yield_cadence(server, PREFILL)
        out["fitted_installed"] = _yield_lines(server, "installed")
        out["fitted_yielded"] = _yield_lines(server, "rid=")
    sys.stderr.write(f"[e2e] calibrate: share {SHARE}: cluster constants cadence "
                     f"{out['cluster']['cadence']}, fitted {out['fit']['value']} cadence "
                     f"{out['fitted']['cadence']}\n")
    return out


def test_calibrate_fits_the_real_servers_log(calibration):
    fit = calibration["fit"]
    assert fit["chunk"]["samples"] >= 8 and fit["step"]["samples"] >= 10
    assert fit["profile_line"].startswith("DSV41_DECODE_YIELD_MODEL=")
    # the CPU engine's chunk costs next to its decode step are nothing like the cluster's
    assert fit["value"] != "20000,65000,277,60000,3000,52000"


def test_receipt_names_the_model_in_use(calibration):
    # one installed line per process that imports the scheduler (scheduler, launcher)
    cluster, fitted = calibration["cluster_installed"], calibration["fitted_installed"]
    assert cluster and fitted
    assert all("cost model: cluster constants 20000,65000,277,60000,3000,52000" in ln for ln in cluster)
    assert all(f"cost model: DSV41_DECODE_YIELD_MODEL={calibration['fit']['value']} (fitted)" in ln
               for ln in fitted)


def test_fitted_share_lands_closer_to_the_configured_share(calibration):
    cluster, fitted = calibration["cluster"], calibration["fitted"]
    assert cluster["long_prompt_completed"] and fitted["long_prompt_completed"]
    target = SHARE / 100
    assert abs(fitted["cadence"] - target) < abs(cluster["cadence"] - target), (cluster, fitted)
    # and through the adapter's own plan: the fit yields more decode steps per chunk
    assert calibration["cluster_yielded"] and calibration["fitted_yielded"]

    def planned(lines):
        return sum(int(ln.split(" decode steps planned")[0].rsplit(", ", 1)[1]) for ln in lines)

    assert planned(calibration["fitted_yielded"]) > 3 * planned(calibration["cluster_yielded"])
