"""Decode yield calibrated on the real CPU server (issue 15).

The dense tiny model with DSV41_DECODE_YIELD=33 and the production line's CPU launch args:
1. the cluster constants (DSV41_DECODE_YIELD_MODEL unset): the session's decode_yield boot
   (tests/e2e/e2e_configs.py), which runs the yield scenario (two streams, a 12,288-token prompt
   in 4,096-token chunks) and traffic.calibration_run; its scheduler log goes through
   `dsv41 calibrate yield`;
2. the fitted model (DSV41_DECODE_YIELD_MODEL=<the printed value>), a boot of its own: the yield
   scenario again.
Asserted: the fit, the receipts naming the model in use, and that each boot planned, for the
same prompt, what its model's planner gives (the integer cost model on replicated state), the
fitted model more: judged on the planner's decisions, not on wall-clock figures of the fit. The
achieved shares (cadence) are printed, not compared: a time ratio across two boots of a 2-core
machine belongs to a benchmark.
"""
from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from adapter import decode_yield
from adapter.cpu.server import CpuServer
from adapter.tools import canary, traffic

from .e2e_configs import PROD_ARGS, REPO_ROOT

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "decode_yield")]

SHARE = 33
KEYS = {"DSV41_DECODE_YIELD": str(SHARE)}
PREFILL = canary.CADENCE_PREFILL["dense"]


def _args():
    args = dict(canary.MODEL_ARGS["dense"])
    args.update(PROD_ARGS)
    return args


def _scheduler_log(run) -> pathlib.Path:
    pids = [role.rsplit(" pid ", 1)[1] for role in run.logs if role.startswith("sglang::scheduler")]
    assert len(pids) == 1, list(run.logs)
    return pathlib.Path(run.log_dir) / f"{pids[0]}.log"


def _yield_lines(lines, what: str) -> list[str]:
    return [ln[ln.index("[dsv41]"):] for ln in lines if f"[dsv41] decode_yield {what}" in ln]


@pytest.fixture(scope="module")
def calibration(boots, tmp_path_factory):
    out = {}
    cluster = boots.config("dense", "decode_yield")     # + the calibration traffic (e2e_configs)
    assert not cluster.errors, cluster.errors
    out["cluster"] = cluster.cadence
    out["sent"] = cluster.extras["calibration_sent"]
    out["cluster_installed"] = _yield_lines(cluster.lines(), "installed")
    out["cluster_yielded"] = _yield_lines(cluster.lines(), "rid=")
    proc = subprocess.run([sys.executable, "-m", "adapter.tools.cli", "calibrate", "yield",
                           "--log", str(_scheduler_log(cluster)), "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out["fit"] = json.loads(proc.stdout)
    fitted_keys = dict(KEYS, DSV41_DECODE_YIELD_MODEL=out["fit"]["value"])
    with CpuServer("dense", keys=fitted_keys, args=_args(), name="calibrate-fitted",
                   log_dir=tmp_path_factory.mktemp("cal-fitted")) as server:
        out["fitted"] = traffic.yield_cadence(server, PREFILL)
        lines = server.log().splitlines()
        out["fitted_installed"] = _yield_lines(lines, "installed")
        out["fitted_yielded"] = _yield_lines(lines, "rid=")
    sys.stderr.write(f"[e2e] calibrate: share {SHARE}: cluster constants cadence "
                     f"{out['cluster']['cadence']}, fitted {out['fit']['value']} cadence "
                     f"{out['fitted']['cadence']} (printed, not compared)\n")
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


def test_the_fitted_model_plans_more_yield_for_the_same_prompt(calibration):
    cluster, fitted = calibration["cluster"], calibration["fitted"]
    assert cluster["long_prompt_completed"] and fitted["long_prompt_completed"]
    assert calibration["cluster_yielded"] and calibration["fitted_yielded"]

    def long_prompt(lines):      # (chunks yielded, steps planned) of the prompt with most chunks
        got = [tuple(int(x) for x in re.search(r"(\d+) chunks yielded, (\d+) decode steps planned",
                                                ln).groups()) for ln in lines]
        return max(got)

    c_chunks, c_planned = long_prompt(calibration["cluster_yielded"])
    f_chunks, f_planned = long_prompt(calibration["fitted_yielded"])
    assert c_chunks == f_chunks > 0                  # the same chunk boundaries
    # Judged on the planner's decisions, not on the fit's wall-clock figures: whatever constants
    # the fit found on this machine under its load, each boot planned what its model gives for the
    # prompt's chunks, with the two streams' contexts anywhere in what they can hold then (the one
    # input that depends on timing). The fitted constants price a CPU chunk far above its decode
    # steps' share, so its range sits above the cluster's.
    cluster_model = decode_yield.CLUSTER
    fitted_model = decode_yield.CostModel(*(int(v) for v in calibration["fit"]["value"].split(",")))
    for planned, model in ((c_planned, cluster_model), (f_planned, fitted_model)):
        low, high = planned_range(model, f_chunks)
        assert low <= planned <= high, (model, planned, low, high)
    assert planned_range(fitted_model, f_chunks)[0] > planned_range(cluster_model, f_chunks)[1]
    assert f_planned > c_planned


def _model_steps(model, chunk: int, prefix: int, rows: int, context: int, interval: int) -> int:
    """The steps after one chunk, computed here from the rule as docs/decode_yield.md and the key's
    doc state it (not with decode_yield's own cost functions): the pass's modelled time
    chunk_fixed + L x tok/1000 + L x (P + L/2) x pair/1e6 + P^2 x sq/1e6 microseconds (integer
    divisions), a decode step's step_fixed + rows x row + context x ctx/1e6, and
    steps = ceil(pct x pass / ((100 - pct) x step)) clamped to [interval, 128]."""
    (chunk_fixed, tok_ns, pair_ps, step_fixed, row_us, ctx_ps, *rest) = tuple(model)
    sq_ps = rest[0] if rest else 0
    pass_us = (chunk_fixed + chunk * tok_ns // 1000 + chunk * (prefix + chunk // 2) * pair_ps // 1_000_000
               + prefix * prefix * sq_ps // 1_000_000)
    step_us = max(step_fixed + rows * row_us + context * ctx_ps // 1_000_000, 1)
    steps = -(-SHARE * pass_us // ((100 - SHARE) * step_us))
    return max(min(steps, 128), interval, 1)


def planned_range(model, chunks: int) -> tuple[int, int]:
    """The decode steps the planner should give the cadence prompt's first `chunks` chunks
    (4,096 tokens each after i x 4,096 cached; the pass holds that chunk alone) beside two streams
    whose contexts are between their 32-token prompts and 32 + STREAM_TOKENS."""
    chunk = int(_args()["--chunked-prefill-size"])
    interval = int(_args().get("--prefill-decode-interval") or 1)
    low = high = 0
    for i in range(chunks):
        low += _model_steps(model, chunk, i * chunk, 2, 2 * (32 + traffic.STREAM_TOKENS), interval)
        high += _model_steps(model, chunk, i * chunk, 2, 2 * 32, interval)   # fewest tokens: most steps
    return low, high
