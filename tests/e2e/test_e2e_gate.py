"""`dsv41 gate` against real CPU servers, quick suite: an A/B/A that passes and three planted
regressions. Five boots, one per configuration (module fixture), one at a time, each stopped by
process group:

    A, A2  stock (the control line)         B  production (the whole line)
    W      stock keys, other weights        D  stock keys, DSV41CPU_STEP_DELAY_MS=40 (planted)

A,B,A2 -> PASS; A,W,A2 -> KILL on T=0; A,D,A2 -> KILL on speed; A,B,D -> INVALID (the controls
disagree on speed). W is measured through the `dsv41 gate run` command, in two goes (resume).
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
from e2e.e2e_configs import CTRL_ARGS, CTRL_KEYS, PROD_ARGS, PROD_KEYS

RUN_ID = "e2e"
DELAY_MS = "40"


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


def boot_w_through_cli(out, model_path):
    """W: booted here, measured by `dsv41 gate run` twice: t0 first, then the rest (resume)."""
    server = CpuServer("dense", keys=CTRL_KEYS, name="gate-W",
                       args={**boot.server_args("dense", CTRL_ARGS), "--model-path": str(model_path)})
    try:
        server.start()
        gate_run.run_gate(server.url, "W", str(out), run_id=RUN_ID, cells=("t0",), progress=False)
        t0_written = (out / RUN_ID / "W" / "t0.json").stat().st_mtime_ns
        code = cli.main(["gate", "run", "--endpoint", server.url + "/v1", "--label", "W", "--out", str(out),
                         "--run-id", RUN_ID, "--model", "dsv41-cpu-dense"])
    finally:
        server.stop()
    assert not server.group_alive()
    return {"code": code, "t0_mtime": t0_written}


@pytest.fixture(scope="module")
def gate(tmp_path_factory):
    out = tmp_path_factory.mktemp("gate-runs")
    records = {}
    for label, keys, args, extra in (("A", CTRL_KEYS, CTRL_ARGS, None), ("B", PROD_KEYS, PROD_ARGS, None),
                                     ("A2", CTRL_KEYS, CTRL_ARGS, None),
                                     ("D", CTRL_KEYS, CTRL_ARGS, {"DSV41CPU_STEP_DELAY_MS": DELAY_MS})):
        records[label] = boot.boot_and_run(label, "dense", keys, args, str(out), RUN_ID, extra_env=extra,
                                           progress=False)
    records["W"] = boot_w_through_cli(out, other_weights_model(tmp_path_factory.mktemp("weights") / "dense-w"))
    return out / RUN_ID, records


def judge(run_dir, order):
    res = verdict.judge(run_dir, order, speed_floor=boot.CPU_SPEED_FLOOR)
    return res, {r["rule"]: r for r in res["rules"]}


def test_stock_production_stock_passes(gate, capsys):
    run_dir, records = gate
    for label in ("A", "B", "A2", "D"):
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
    assert cli.main(["gate", "verdict", str(run_dir), "--order", "A,B,A2", "--speed-floor",
                     str(boot.CPU_SPEED_FLOOR)]) == 0
    assert "verdict: PASS" in capsys.readouterr().out
    md = (run_dir / "report.md").read_text()
    assert md.startswith("# dsv41 gate: PASS")
    for png in ("speed.png", "resume.png", "kld.png"):
        assert (run_dir / png).read_bytes()[:4] == b"\x89PNG"


def test_other_weights_are_killed_on_t0_equality(gate):
    run_dir, records = gate
    assert records["W"]["code"] == 0
    res, rules = judge(run_dir, "A,W,A2")
    assert res["verdict"] == "KILL" and "t0" in res["decided_by"], verdict.format_text(res)
    assert len(rules["t0"]["figures"]["differ"]) >= 12
    assert rules["kld"]["outcome"] == "KILL"                          # and far from the controls
    assert rules["controls.speed"]["outcome"] == rules["controls.t0"]["outcome"] == "ok"


def test_gate_run_resumes(gate):
    run_dir, records = gate
    # W's t0 cell was measured by the first `gate run`; the second one left it alone.
    assert (run_dir / "W" / "t0.json").stat().st_mtime_ns == records["W"]["t0_mtime"]
    assert gate_run.label_complete(run_dir / "W")
    # A complete label is not booted again.
    again = boot.boot_and_run("A", "dense", CTRL_KEYS, CTRL_ARGS, str(run_dir.parent), RUN_ID)
    assert again["skipped"] == "measured already"


def test_step_delay_is_killed_on_speed(gate):
    run_dir, records = gate
    res, rules = judge(run_dir, "A,D,A2")
    assert res["verdict"] == "KILL" and res["decided_by"] == ["speed"], verdict.format_text(res)
    for cell in cells.SPEED_CELLS:
        assert rules["speed"]["figures"]["cells"][cell]["candidate_ratio"] < 0.35, cell
    logs = "".join(p.read_text(errors="replace") for p in pathlib.Path(records["D"]["log_dir"]).glob("*.log"))
    assert f"step delay armed: Scheduler.run_batch sleeps {DELAY_MS} ms" in logs


def test_controls_that_disagree_are_invalid(gate, capsys):
    run_dir, _ = gate
    res, rules = judge(run_dir, "A,B,D")
    assert res["verdict"] == "INVALID" and res["decided_by"] == ["controls.speed"], verdict.format_text(res)
    assert cli.main(["gate", "verdict", str(run_dir), "--order", "A,B,D", "--json", "--speed-floor",
                     str(boot.CPU_SPEED_FLOOR)]) == exits.INVALID
    assert json.loads(capsys.readouterr().out)["verdict"] == "INVALID"
