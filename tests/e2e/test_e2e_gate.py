"""`dsv41 gate` against real CPU servers, quick suite: an A/B/A that passes and two planted
regressions in one boot. Four boots, one per configuration (module fixture), one at a time, each
stopped by process group:

    A, A2  stock (the control line)         B  production (the whole line)
    WD     stock keys, other weights and DSV41CPU_STEP_EXTRA_WORK (both planted: the scheduler works
           EXTRA_WORK x each batch's CPU time more, adapter/cpu/step_work.py)

A,B,A2 -> PASS (neither the T=0 rules nor the speed rules fire on equal boots); A,WD,A2 -> KILL,
by T=0 (the other weights) and by speed (the delay), each rule on its own figures; A,B,WD ->
INVALID (the controls disagree). Every boot's speed cells record tokens per server CPU-second
(`--server-pid`), which the verdict judges: boots measured minutes apart beside the suite's other
servers see different load, and their wall-clock rates swung 3x (a KILL of the equal production
line, issue 40). The planted regression is proportional work, so its ratio does not move with the
machine's load either: the test prints it ("candidate speed ratio"). WD is measured through the `dsv41 gate run` command, in two goes
(resume). One boot carries both regressions (issue 26: fewer boots); that each rule fires alone
and only on its own figures is the verdict's unit tests' (tests/test_gate_verdict.py).
"""
import json
import pathlib
import shutil
from unittest import mock

import pytest

from adapter.cpu import models
from adapter.cpu.server import CpuServer
from adapter.tools import cli, exits
from adapter.tools.gate import boot, cells, verdict
from adapter.tools.gate import run as gate_run
from e2e.e2e_configs import CTRL_ARGS, CTRL_KEYS, PROD_ARGS, PROD_KEYS, SUMMARY_LINES

RUN_ID = "e2e"
# ~0.17 x the controls' tokens per server CPU-second (the launcher's HTTP / tokenizer work is not
# slowed, so the factor is larger than 1 / 0.17 - 1)
EXTRA_WORK = "8"


def other_weights_model(dst):
    """The dense model's config and tokenizer, weights drawn by its recipe from another seed."""
    import transformers
    from safetensors.torch import save_file

    src = models.ensure_model("dense")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors"))
    recipe = models.RECIPES["dense"]
    config = getattr(transformers, recipe.config_class).from_pretrained(str(src))
    with mock.patch.object(models, "SEED", models.SEED + 1):
        tensors = models._weights(recipe, config)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def boot_wd_through_cli(out, model_path):
    """WD: booted here, measured by `dsv41 gate run` twice: t0 first, then the rest (resume)."""
    server = CpuServer("dense", keys=CTRL_KEYS, name="gate-WD", extra_env={"DSV41CPU_STEP_EXTRA_WORK": EXTRA_WORK},
                       args={**boot.server_args("dense", CTRL_ARGS), "--model-path": str(model_path)})
    try:
        server.start()
        gate_run.run_gate(server.url, "WD", str(out), run_id=RUN_ID, cells=("t0",), progress=False,
                          server_pid=server.proc.pid)
        t0_written = (out / RUN_ID / "WD" / "t0.json").stat().st_mtime_ns
        code = cli.main(["gate", "run", "--endpoint", server.url + "/v1", "--label", "WD", "--out", str(out),
                         "--run-id", RUN_ID, "--model", "dsv41-cpu-dense", "--server-pid", str(server.proc.pid)])
    finally:
        server.stop()
    assert not server.group_alive()
    return {"code": code, "t0_mtime": t0_written, "log_dir": str(server.log_dir)}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-runs")
    records = {}
    for label, keys, args in (("A", CTRL_KEYS, CTRL_ARGS), ("B", PROD_KEYS, PROD_ARGS),
                              ("A2", CTRL_KEYS, CTRL_ARGS)):
        records[label] = boot.boot_and_run(label, "dense", keys, args, str(out), RUN_ID, progress=False)
    records["WD"] = boot_wd_through_cli(out, other_weights_model(tmp_path_factory.mktemp("weights") / "dense-w"))
    return out / RUN_ID, records


def judge(run_dir, order):
    res = verdict.judge(run_dir, order, speed_floor=boot.CPU_SPEED_FLOOR, t1_alpha=boot.CPU_T1_ALPHA)
    return res, {r["rule"]: r for r in res["rules"]}


def test_stock_production_stock_passes(gate, capsys):
    run_dir, records = gate
    for label in ("A", "B", "A2"):
        assert gate_run.label_complete(run_dir / label), label
        assert json.loads((run_dir / label / "boot.json").read_text())["measure_s"] > 0
    res, rules = judge(run_dir, "A,B,A2")
    assert res["verdict"] == "PASS", verdict.format_text(res)
    assert rules["t0"]["figures"]["equal"] == rules["t0"]["figures"]["agreed"] == 15
    assert rules["controls.t0"]["figures"]["excluded"] == []
    assert rules["kld"]["figures"]["groups"]["long"]["candidate"] < 1e-6      # float32 CPU: ~0
    assert rules["soak"]["figures"]["failures"] == 0 and rules["soak"]["figures"]["requests"] > 20
    assert all(run_dir.joinpath(lb, "soak.json").exists() for lb in ("A", "B", "A2"))
    soak = json.loads((run_dir / "B" / "soak.json").read_text())
    assert soak["metrics_answered"], "the soak's /metrics sampler got no answer (--enable-metrics)"
    resume = json.loads((run_dir / "B" / "resume.json").read_text())
    assert resume["evicted"] and resume["warm_cached_tokens"] > 0.9 * resume["doc_tokens"]
    assert resume["evicted_cached_tokens"] < resume["warm_cached_tokens"]
    # The command: exit 0, the report and its plots next to the run.
    assert cli.main(["gate", "verdict", str(run_dir), "--order", "A,B,A2", "--t1-alpha", str(boot.CPU_T1_ALPHA), "--speed-floor",
                     str(boot.CPU_SPEED_FLOOR)]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    md = (run_dir / "report.md").read_text()
    assert md.startswith("# dsv41 gate: PASS")
    for png in ("speed.png", "resume.png", "kld.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"


def test_other_weights_and_step_work_are_killed_on_t0_and_on_speed(gate):
    run_dir, records = gate
    assert records["WD"]["code"] == 0
    res, rules = judge(run_dir, "A,WD,A2")
    speed = rules["speed"]["figures"]["cells"]
    ratios = [speed[c]["candidate_ratio"] for c in cells.SPEED_CELLS]
    line = (f"candidate speed ratio {sum(ratios) / len(ratios):.2f} (per cell: "
            + ", ".join(f"{c} {speed[c]['candidate_ratio']:.2f}" for c in cells.SPEED_CELLS) + ")")
    print(line)
    SUMMARY_LINES.append(f"gate: {line}")       # in the session's summary too (no -s needed)
    assert {speed[c]["basis"] for c in cells.SPEED_CELLS} == {"cpu_tok_s_reps"}
    assert res["verdict"] == "KILL", verdict.format_text(res)
    assert "t0" in res["decided_by"] and "speed" in res["decided_by"], res["decided_by"]
    assert len(rules["t0"]["figures"]["differ"]) >= 12                # the other weights
    assert rules["kld"]["outcome"] == "KILL"                          # and far from the controls
    assert rules["t1"]["outcome"] == "KILL"                           # at the harness's alpha too
    for cell in cells.SPEED_CELLS:                                    # the extra work
        assert speed[cell]["candidate_ratio"] < 0.35, cell
    assert rules["controls.speed"]["outcome"] == rules["controls.t0"]["outcome"] == "ok"
    logs = "".join(p.read_text(errors="replace") for p in pathlib.Path(records["WD"]["log_dir"]).glob("*.log"))
    assert f"step extra work armed: after each Scheduler.run_batch the scheduler thread works {EXTRA_WORK} x" in logs


def test_gate_run_resumes(gate):
    run_dir, records = gate
    # WD's t0 cell was measured by the first `gate run`; the second one left it alone.
    assert (run_dir / "WD" / "t0.json").stat().st_mtime_ns == records["WD"]["t0_mtime"]
    assert gate_run.label_complete(run_dir / "WD")
    # A complete label is not booted again.
    again = boot.boot_and_run("A", "dense", CTRL_KEYS, CTRL_ARGS, str(run_dir.parent), RUN_ID)
    assert again["skipped"] == "measured already"


def test_controls_that_disagree_are_invalid(gate, capsys):
    run_dir, _ = gate
    res, rules = judge(run_dir, "A,B,WD")
    assert res["verdict"] == "INVALID", verdict.format_text(res)
    assert "controls.speed" in res["decided_by"] and "controls.t0" in res["decided_by"], res["decided_by"]
    assert cli.main(["gate", "verdict", str(run_dir), "--order", "A,B,WD", "--json", "--t1-alpha", str(boot.CPU_T1_ALPHA), "--speed-floor",
                     str(boot.CPU_SPEED_FLOOR)]) == exits.INVALID
    assert json.loads(capsys.readouterr().out)["verdict"] == "INVALID"
