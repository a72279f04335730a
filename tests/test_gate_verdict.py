"""Small fixture runs for the gate's unit tests: label directories in the exact layout `gate run`
writes (adapter/tools/gate/run.py), with controllable measurements."""
from __future__ import annotations

import pathlib

import numpy as np

from adapter.tools.gate import cells as C
from adapter.tools.gate import run as gate_run

T0_IDS = [f"p{i:02d}" for i in range(12)]
KLD_PROMPTS = (("kld-short-a", "short", 30), ("kld-short-b", "short", 30), ("kld-long", "long", 60))
VOCAB = [f"t{i}" for i in range(40)]
T1_IDS = ("t1-a", "t1-b", "t1-c")


def base_logits(prompt: str, position: int) -> np.ndarray:
    seed = sum(map(ord, prompt)) * 1000 + position
    return np.random.default_rng(seed).normal(0.0, 2.0, len(VOCAB))


def top_logprobs(logits: np.ndarray, k: int = 5) -> dict:
    lp = logits - np.log(np.sum(np.exp(logits - logits.max()))) - logits.max()
    order = np.argsort(-lp)[:k]
    return {VOCAB[i]: float(lp[i]) for i in order}


def t1_probs(prompt: str, tilt: float = 0.0) -> np.ndarray:
    w = np.exp(np.random.default_rng(sum(map(ord, prompt))).normal(0.0, 1.0, 12) + tilt * np.arange(12) / 11)
    return w / w.sum()


def make_label(run_dir: pathlib.Path, label: str, *, speed: float = 200.0, jitter: float = 0.04,
               speed_by_cell: dict | None = None, t0_override: dict | None = None, kld_sigma: float = 0.0,
               kld_seed: int = 0, t1_tilt: float = 0.0, t1_seed: int = 0, t1_samples: int = 600,
               needle_found: bool = True, needle_text: str = " 7319.", soak_failures: int = 0,
               suite: str = "quick", model: str = "m", skip_cells: tuple = ()) -> pathlib.Path:
    d = pathlib.Path(run_dir) / label
    d.mkdir(parents=True, exist_ok=True)
    gate_run._write_json(d / "meta.json", {"label": label, "endpoint": "http://127.0.0.1:1", "model": model,
                                           "suite": suite, "context_length": 8192, "pool_tokens": 16384,
                                           "filler_tokens": [100] * 5, "plan": C.plan_for(suite, 8192)})

    def cell(name, summary, samples):
        if name in skip_cells:
            return
        gate_run._write_samples(d / f"{name}.samples.jsonl", samples)
        gate_run._write_json(d / f"{name}.json", {"cell": name, "elapsed_s": 1.0, **summary})

    for name, (conc, sampled) in C.SPEED_CELLS.items():
        m = (speed_by_cell or {}).get(name, speed) * conc
        reps = [m * (1 + jitter * x) for x in (-1.0, -0.5, 0.0, 0.5, 1.0)]
        cell(name, {"concurrency": conc, "sampled": sampled, "tok_s": float(np.median(reps)), "tok_s_reps": reps,
                    "ttft_p50_s": 0.02, "ttft_p90_s": 0.03, "itl_p50_s": 1 / m, "itl_p90_s": 1.2 / m,
                    "itl_p99_s": 1.5 / m}, [])
    t0 = {i: f" answer of {i}" for i in T0_IDS}
    t0.update(t0_override or {})
    cell("t0", {"prompts": len(t0)}, [{"id": i, "kind": "completion", "text": text, "tokens": text.split(" "),
                                       "logprobs": [], "prompt_tokens": 10} for i, text in t0.items()])
    rng = np.random.default_rng(kld_seed)
    kld = []
    for pid, group, n in KLD_PROMPTS:
        tops = [top_logprobs(base_logits(pid, pos) + kld_sigma * rng.normal(0, 1, len(VOCAB))) for pos in range(n)]
        kld.append({"id": pid, "group": group, "prompt_tokens": n, "positions": list(range(n)),
                    "tokens": [f"x{pos}" for pos in range(n)], "top": tops})
    cell("kld", {"topk": 5}, kld)
    rng = np.random.default_rng(1000 + t1_seed)
    t1 = []
    for pid in T1_IDS:
        p = t1_probs(pid, t1_tilt)
        t1.append({"id": pid, "first_tokens": [VOCAB[i] for i in rng.choice(len(p), t1_samples, p=p)]})
    cell("t1", {"samples_per_prompt": t1_samples}, t1)
    cell("needle", {"found": needle_found, "text": needle_text, "prompt_tokens": 7000, "ttft_s": 0.4,
                    "answer": "7319"}, [])
    cell("resume", {"cold_ttft_s": 0.1, "warm_ttft_s": 0.05, "evicted_ttft_s": 0.09, "warm_cached_tokens": 2000,
                    "evicted_cached_tokens": 0, "cold_cached_tokens": 0,
                    "texts": {"cold": " r", "warm": " r2", "evicted": " r2"}}, [])
    cell("soak", {"requests": 100, "failures": soak_failures, "companion_failures": 0, "companion_streams": 10,
                  "failure_lines": ["worker 0: APIConnectionError: boom"] * soak_failures}, [])
    return d


def make_run(tmp_path: pathlib.Path, a: dict | None = None, b: dict | None = None, a2: dict | None = None,
             labels=("A", "B", "A2")) -> pathlib.Path:
    run_dir = tmp_path / "run1"
    make_label(run_dir, labels[0], **({"kld_seed": 1, "t1_seed": 1} | (a or {})))
    make_label(run_dir, labels[1], **({"kld_seed": 2, "t1_seed": 2} | (b or {})))
    make_label(run_dir, labels[2], **({"kld_seed": 3, "t1_seed": 3} | (a2 or {})))
    return run_dir


# --- the rules ------------------------------------------------------------------------------

import json  # noqa: E402

import pytest  # noqa: E402

from adapter.tools import cli  # noqa: E402
from adapter.tools.gate import report, verdict  # noqa: E402


def judge(run_dir, order="A,B,A2", **kw):
    return verdict.judge(run_dir, order, **kw)


def outcomes(result) -> dict:
    return {r["rule"]: r["outcome"] for r in result["rules"]}


def by_rule(result, name) -> dict:
    return next(r for r in result["rules"] if r["rule"] == name)


def test_alike_boots_pass(tmp_path):
    res = judge(make_run(tmp_path))
    assert res["verdict"] == "PASS", verdict.format_text(res)
    assert set(outcomes(res).values()) == {"ok"}
    assert by_rule(res, "t0")["figures"]["equal"] == by_rule(res, "t0")["figures"]["agreed"] == 15  # 12 + resume 3
    kld = by_rule(res, "kld")["figures"]["groups"]
    # Identical distributions: KL is 0 in exact arithmetic; the sum over bins leaves rounding residue
    # whose size depends on the CPU's summation (1.1e-18 seen on one machine). 1e-12 is six orders
    # below the smallest threshold the rule applies (0.0045), so it cannot hide a real divergence.
    assert abs(kld["long"]["candidate"]) <= 1e-12 and abs(kld["long"]["controls"]) <= 1e-12
    assert kld["long"]["threshold"] == verdict.KLD_REFERENCE["long"]
    assert kld["short"]["threshold"] == verdict.KLD_REFERENCE["short"]


def test_candidate_t0_difference_kills(tmp_path):
    res = judge(make_run(tmp_path, b={"t0_override": {"p03": " another answer"}}))
    assert res["verdict"] == "KILL" and res["decided_by"] == ["t0"]
    t0 = by_rule(res, "t0")["figures"]
    assert t0["differ"] == ["p03"] and t0["equal"] == 14
    assert t0["diffs"]["p03"] == {"controls": " answer of p03", "candidate": " another answer"}


def test_prompt_the_controls_differ_on_is_excluded(tmp_path):
    res = judge(make_run(tmp_path, a2={"t0_override": {"p05": " drift"}}, b={"t0_override": {"p05": " other"}}))
    assert res["verdict"] == "PASS"
    assert by_rule(res, "controls.t0")["figures"]["excluded"] == ["p05"]
    assert by_rule(res, "t0")["figures"]["agreed"] == 14


def test_too_many_excluded_prompts_is_invalid(tmp_path):
    drift = {f"p0{i}": " drift" for i in range(3)}
    res = judge(make_run(tmp_path, a2={"t0_override": drift}))
    assert res["verdict"] == "INVALID" and res["decided_by"] == ["controls.t0"]
    assert by_rule(res, "controls.t0")["figures"]["max_excluded"] == 1
    assert judge(make_run(tmp_path, a2={"t0_override": drift}), max_excluded=3)["verdict"] == "PASS"


def test_kld_above_reference_kills(tmp_path):
    res = judge(make_run(tmp_path, b={"kld_sigma": 0.5}))
    assert res["verdict"] == "KILL" and res["decided_by"] == ["kld"]
    groups = by_rule(res, "kld")["figures"]["groups"]
    assert groups["long"]["candidate"] > verdict.KLD_REFERENCE["long"]
    assert groups["short"]["candidate"] > verdict.KLD_REFERENCE["short"]


def test_kld_small_perturbation_passes(tmp_path):
    res = judge(make_run(tmp_path, b={"kld_sigma": 0.01}))
    groups = by_rule(res, "kld")["figures"]["groups"]
    assert 0 < groups["long"]["candidate"] < verdict.KLD_REFERENCE["long"]
    assert res["verdict"] == "PASS"


def test_kld_threshold_follows_the_controls_own_divergence(tmp_path):
    # Noisy controls (as on GPUs): the threshold is KLD_FACTOR x their divergence, not the reference.
    run = make_run(tmp_path, a={"kld_sigma": 0.3}, a2={"kld_sigma": 0.3}, b={"kld_sigma": 0.3})
    res = judge(run)
    g = by_rule(res, "kld")["figures"]["groups"]["long"]
    assert g["controls"] > g["reference"] and g["threshold"] == pytest.approx(verdict.KLD_FACTOR * g["controls"])
    assert res["verdict"] == "PASS"
    run = make_run(tmp_path, a={"kld_sigma": 0.3}, a2={"kld_sigma": 0.3}, b={"kld_sigma": 1.2})
    assert judge(run)["decided_by"] == ["kld"]


def test_position_kl():
    p = {"a": np.log(0.7), "b": np.log(0.2)}
    assert verdict.position_kl(p, dict(p)) == pytest.approx(0.0, abs=1e-12)
    q = {"a": np.log(0.5), "b": np.log(0.4)}
    want = 0.7 * np.log(0.7 / 0.5) + 0.2 * np.log(0.2 / 0.4) + 0.1 * np.log(0.1 / 0.1)
    assert verdict.position_kl(p, q) == pytest.approx(want)
    # "b" is not in Q's top-k: it gets at most Q's smallest listed probability and the tail.
    q = {"a": np.log(0.6), "c": np.log(0.3)}
    got = verdict.position_kl(p, q)
    want = 0.7 * np.log(0.7 / 0.6) + 0.2 * np.log(0.2 / 0.1) + 0.1 * np.log(0.1 / 0.3)
    assert got == pytest.approx(want) and got > 0


def test_t1_shifted_distribution_kills(tmp_path):
    res = judge(make_run(tmp_path, b={"t1_tilt": 1.5}))
    assert res["verdict"] == "KILL" and res["decided_by"] == ["t1"]
    assert all(t["p"] < 1e-3 for t in by_rule(res, "t1")["figures"]["tests"].values())


@pytest.mark.parametrize("seed", range(5))
def test_t1_same_distribution_passes(tmp_path, seed):
    res = judge(make_run(tmp_path, a={"t1_seed": 10 + seed}, b={"t1_seed": 20 + seed}, a2={"t1_seed": 30 + seed}))
    assert outcomes(res)["t1"] == "ok" and outcomes(res)["controls.t1"] == "ok"


def test_t1_controls_that_differ_are_invalid(tmp_path):
    res = judge(make_run(tmp_path, a2={"t1_tilt": 1.5}))
    assert res["verdict"] == "INVALID" and "controls.t1" in res["decided_by"]


def test_two_sample_test_merges_rare_tokens():
    x = ["a"] * 90 + ["b"] * 8 + ["r1", "r2"]
    y = ["a"] * 88 + ["b"] * 10 + ["r3", "r4"]
    r = verdict.two_sample_test(x, y)
    assert r["distinct"] == 6 and r["categories"] == 2 and r["p"] > 0.5      # r* folded into "b"
    one = verdict.two_sample_test(["a"] * 50, ["a"] * 40)    # one category: nothing to test
    assert one["categories"] == 1 and one["dof"] == 0
    assert one["p"] == pytest.approx(1.0, abs=1e-12)         # p is a float: no exact compare


def test_needle_rules(tmp_path):
    assert judge(make_run(tmp_path, b={"needle_found": False}))["decided_by"] == ["needle"]
    assert judge(make_run(tmp_path, a2={"needle_found": False}))["decided_by"] == ["controls.needle"]
    lost = {"needle_found": False, "needle_text": " 1234"}
    res = judge(make_run(tmp_path, a=lost, a2=lost, b=lost))
    assert res["verdict"] == "PASS" and "equals theirs" in by_rule(res, "needle")["why"]
    res = judge(make_run(tmp_path, a=lost, a2=lost, b={"needle_found": False, "needle_text": " 99"}))
    assert res["decided_by"] == ["needle"]


def test_soak_failures(tmp_path):
    res = judge(make_run(tmp_path, b={"soak_failures": 1}))
    assert res["decided_by"] == ["soak"] and "boom" in by_rule(res, "soak")["why"]
    assert judge(make_run(tmp_path, a={"soak_failures": 2}))["decided_by"] == ["controls.soak"]


def test_speed_regression_kills(tmp_path):
    res = judge(make_run(tmp_path, b={"speed": 40.0}), speed_floor=0.5)
    assert res["verdict"] == "KILL" and res["decided_by"] == ["speed"]
    cells = by_rule(res, "speed")["figures"]["cells"]
    assert all(c["candidate_ratio"] == pytest.approx(0.2) for c in cells.values())


def test_speed_within_the_floor_passes(tmp_path):
    # 30 % slower: inside the CPU floor (0.5), outside the cluster's (0.03).
    assert judge(make_run(tmp_path, b={"speed": 140.0}), speed_floor=0.5)["verdict"] == "PASS"
    assert judge(make_run(tmp_path, b={"speed": 140.0}))["decided_by"] == ["speed"]


def test_speed_regression_on_one_cell_kills(tmp_path):
    res = judge(make_run(tmp_path, b={"speed_by_cell": {"speed-c4-sampled": 180.0}}))
    assert res["decided_by"] == ["speed"] and "speed-c4-sampled" in by_rule(res, "speed")["why"]


def test_speed_tolerance_grows_with_the_controls_spread(tmp_path):
    # Noisy controls (IQR 40 %): a candidate 30 % slower is within their spread.
    run = make_run(tmp_path, a={"jitter": 0.4}, a2={"jitter": 0.4}, b={"speed": 140.0})
    res = judge(run)
    assert res["verdict"] == "PASS", verdict.format_text(res)
    assert by_rule(res, "controls.speed")["figures"]["cells"]["speed-c1-greedy"]["tolerance"] == pytest.approx(0.4)


def test_controls_that_disagree_on_speed_are_invalid(tmp_path):
    res = judge(make_run(tmp_path, a2={"speed": 40.0}, b={"t0_override": {"p01": " x"}}), speed_floor=0.5)
    assert res["verdict"] == "INVALID" and res["decided_by"] == ["controls.speed"]
    assert outcomes(res)["t0"] == "KILL"          # listed, but INVALID wins
    # A candidate faster than both controls is no regression.
    assert judge(make_run(tmp_path, b={"speed": 400.0}))["verdict"] == "PASS"


# --- errors, CLI, report --------------------------------------------------------------------

def run_cli(argv, capsys):
    code = cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_and_exit_codes(tmp_path, capsys):
    run = make_run(tmp_path, b={"speed": 40.0})
    code, out, _ = run_cli(["gate", "verdict", str(run), "--order", "A,B,A2", "--json", "--speed-floor", "0.5"],
                           capsys)
    body = json.loads(out)
    assert code == 1 and body["verdict"] == "KILL" and body["decided_by"] == ["speed"]
    assert {r["rule"] for r in body["rules"]} == {"controls.speed", "speed", "controls.t0", "t0", "kld",
                                                   "controls.t1", "t1", "controls.needle", "needle",
                                                   "controls.soak", "soak"}
    assert all({"rule", "outcome", "why", "figures"} <= set(r) for r in body["rules"])
    assert json.loads((run / "verdict.json").read_text())["verdict"] == "KILL"
    code, out, _ = run_cli(["gate", "verdict", str(make_run(tmp_path))], capsys)
    assert code == 0 and "verdict: PASS" in out
    code, out, _ = run_cli(["gate", "verdict", str(make_run(tmp_path, a2={"soak_failures": 1}))], capsys)
    assert code == 4 and "verdict: INVALID (by controls.soak)" in out   # exits.INVALID


def test_cli_errors_exit_2(tmp_path, capsys):
    run = make_run(tmp_path)
    code, _, err = run_cli(["gate", "verdict", str(run), "--order", "A,C,A2"], capsys)
    assert code == 2 and "no measured label C" in err and "A, A2, B" in err
    code, _, err = run_cli(["gate", "verdict", str(tmp_path / "nope")], capsys)
    assert code == 2 and "no such run directory" in err
    code, _, err = run_cli(["gate", "verdict", str(run), "--order", "A,B"], capsys)
    assert code == 2 and "three labels" in err
    make_label(run, "C", skip_cells=("soak", "needle"))
    code, _, err = run_cli(["gate", "verdict", str(run), "--order", "A,C,A2"], capsys)
    assert code == 2 and "incomplete" in err and "needle, soak" in err
    make_label(run, "F", suite="full")
    code, _, err = run_cli(["gate", "verdict", str(run), "--order", "A,F,A2"], capsys)
    assert code == 2 and "different suite" in err
    code, _, err = run_cli(["gate", "verdict", str(run), "--t1-alpha", "2"], capsys)
    assert code == 2 and "t1-alpha" in err


def test_report_renders(tmp_path):
    run = make_run(tmp_path, b={"speed": 40.0, "kld_sigma": 0.5})
    res = judge(run, speed_floor=0.5)
    paths = report.write(res, run)
    md = paths["report"].read_text()
    assert md.startswith("# dsv41 gate: KILL") and "| speed | KILL |" in md and "| kld | KILL |" in md
    assert "| speed-c1-greedy tok/s (median, range) | 200.0 (192-208) | 40.0 (38-42) | 200.0 (192-208) |" in md
    for name in ("speed", "resume", "kld"):
        blob = paths[name].read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 5000, name
        assert f"![{name}]({name}.png)" in md
