"""`dsv41 gate verdict runs/<run-id> --order A,B,A2`: PASS / KILL / INVALID of an A/B/A.

The order names control, candidate, control (the labels of three `gate run`s of one run id). Every
rule compares the candidate with the two controls, and the controls with each other; the rules,
their thresholds and why they are set so are in docs/gate.md. In short:

  INVALID (the controls disagree beyond their own noise: the A/B/A says nothing)
    speed     on a speed cell the slower control's median is more than the controls' noise below
              the faster one's; noise: the larger of --speed-floor and each control's relative
              interquartile range of repeats
    t0        more T=0 prompts than --max-excluded on which the controls' outputs differ
    t1        the T=1 test rejects between the two controls
    needle    one control found the needle and the other did not
    soak      a control's soak had a failed request
  KILL (the candidate is worse, the controls agreeing)
    t0        a T=0 output differs on a prompt the controls agree on
    kld       mean KL(control || candidate) of a group (long, short) above
              max(reference, KLD_FACTOR x KL(control || control)); reference: the cluster's
              accepted 0.00677 (long) / 0.0045 (short), --kld-long / --kld-short
    t1        the T=1 first-token distribution of the candidate differs from the pooled controls'
              (chi-square, Bonferroni over prompts, --t1-alpha)
    needle    the controls found it and the candidate did not (controls both lost it: the
              candidate's answer must equal theirs at T=0)
    soak      any failed request or short companion stream
    speed     a speed cell's candidate median below mean(A, A2) x (1 - tolerance); tolerance: the
              largest of that noise, the controls' own shortfall (1 - slower / faster) and the
              relative interquartile range of all control repeats of the cell
  PASS otherwise. INVALID wins over KILL (the KILL rules are still listed).

Exit status: 0 PASS, 1 KILL, 3 INVALID, 2 when it cannot judge (missing labels or cells, runs of
another suite or model). A report (report.md, PNG plots: report.py) and verdict.json are written
into the run directory.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys
from typing import Optional

import numpy as np

from adapter.tools.gate import cells as C
from adapter.tools import exits
from adapter.tools.gate import run as gate_run

# The cluster's accepted v2.6.4 candidate (../SPEC "Release evidence"): KLD long / short.
KLD_REFERENCE = {"long": 0.00677, "short": 0.0045}
KLD_FACTOR = 2.0           # the candidate may be this many times as far as the controls are apart
INVALID_FACTOR = 1.0       # the slower control further below the faster than the noise: INVALID
DEFAULTS = {"speed_floor": 0.03, "kld_long": KLD_REFERENCE["long"], "kld_short": KLD_REFERENCE["short"],
            "t1_alpha": 0.01, "max_excluded": None}
MIN_EXPECTED = 5.0         # chi-square: categories merged until every expected count is >= 5
EPS = 1e-12
EXIT = {"PASS": exits.OK, "KILL": exits.FAILED, "INVALID": exits.INVALID}


# --- loading ---------------------------------------------------------------------------------

def parse_order(order: str) -> tuple[str, str, str]:
    labels = [x.strip() for x in (order or "").split(",")]
    if len(labels) != 3 or not all(labels) or labels[0] == labels[2] or labels[1] in (labels[0], labels[2]):
        raise C.GateError(f"--order {order!r}: name three labels, control,candidate,control (e.g. A,B,A2)")
    return labels[0], labels[1], labels[2]


def load_run(run_dir, order: tuple[str, str, str]) -> dict:
    """{label: gate_run.load_label(...)} of the three labels; a clear GateError when they cannot
    be judged (missing, incomplete, measured with another suite, model or context length)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise C.GateError(f"{run_dir}: no such run directory")
    present = sorted(p.name for p in run_dir.iterdir() if (p / "meta.json").is_file())
    missing = [lb for lb in order if lb not in present]
    if missing:
        raise C.GateError(f"{run_dir}: no measured label {', '.join(missing)} (labels here: "
                          f"{', '.join(present) or 'none'})")
    try:
        data = {lb: gate_run.load_label(run_dir / lb) for lb in order}
    except ValueError as exc:
        raise C.GateError(f"{run_dir}: a file is not valid JSON ({exc}); re-measure that cell") from exc
    for lb, d in data.items():
        absent = [c for c in C.CELLS if c not in d["cells"]]
        if absent:
            raise C.GateError(f"{run_dir / lb}: incomplete, cells not measured: {', '.join(absent)} "
                              f"(re-run `dsv41 gate run` with the same --run-id and --label to resume)")
    first = data[order[0]]["meta"]
    for lb in order[1:]:
        meta = data[lb]["meta"]
        for key in ("suite", "model", "context_length"):
            if meta.get(key) != first.get(key):
                raise C.GateError(f"labels {order[0]} and {lb} were measured with different {key} "
                                  f"({first.get(key)!r} / {meta.get(key)!r}): they do not compare")
    ids = [sorted(s["id"] for s in data[lb]["samples"]["t0"]) for lb in order]
    if any(x != ids[0] for x in ids):
        raise C.GateError("the labels were measured on different T=0 prompt sets")
    return data


# --- rule helpers ----------------------------------------------------------------------------

def rule(name: str, outcome: str, why: str, **figures) -> dict:
    """One rule's result; outcome: ok, KILL, INVALID or n/a."""
    return {"rule": name, "outcome": outcome, "why": why, "figures": figures}


def rel_spread(values) -> float:
    """Interquartile range of repeats relative to their median (robust to one stalled repeat)."""
    values = np.asarray([float(v) for v in values])
    med = float(np.median(values))
    q75, q25 = np.percentile(values, [75, 25])
    return float(q75 - q25) / med if med > 0 else math.inf


def speed_rules(a: dict, b: dict, a2: dict, floor: float) -> list[dict]:
    """Per speed cell, on the medians of the repeats. noise = max(floor, each control's relative
    IQR); INVALID when the slower control is below (1 - noise) x the faster one; KILL when the
    candidate is below (1 - tolerance) x mean(A, A2), tolerance = max(noise, the controls' own
    shortfall 1 - slower/faster, the relative IQR of all control repeats)."""
    per_cell, invalid, kill = {}, [], []
    for cell in C.SPEED_CELLS:
        basis = speed_basis(cell, a, b, a2)
        ra, rb, ra2 = (d["cells"][cell][basis] for d in (a, b, a2))
        ma, mb, ma2 = (float(np.median(r)) for r in (ra, rb, ra2))
        ctrl = (ma + ma2) / 2
        noise = max(floor, rel_spread(ra), rel_spread(ra2))
        shortfall = 1 - min(ma, ma2) / max(ma, ma2) if max(ma, ma2) > 0 else 1.0
        tol = max(noise, shortfall, rel_spread(list(ra) + list(ra2)))
        ratio = mb / ctrl if ctrl > 0 else 0.0
        per_cell[cell] = {"basis": basis, "control_tok_s": [ma, ma2], "candidate_tok_s": mb, "control_mean": ctrl,
                          "control_shortfall": shortfall, "control_noise": noise, "candidate_ratio": ratio,
                          "tolerance": tol, "kill_below": 1 - tol}
        unit = "tok/s" if basis == "tok_s_reps" else "tok per server CPU-s"
        if shortfall > INVALID_FACTOR * noise:
            invalid.append(f"{cell}: controls {ma:.1f} / {ma2:.1f} {unit}, the slower {shortfall:.0%} below "
                           f"the faster > noise {noise:.0%}")
        if ratio < 1 - tol:
            kill.append(f"{cell}: {mb:.1f} {unit} = {ratio:.2f} x the controls' mean {ctrl:.1f} "
                        f"(kill below {1 - tol:.2f})")
    return [
        rule("controls.speed", "INVALID" if invalid else "ok",
             "; ".join(invalid) or "control medians within their noise on every speed cell", cells=per_cell),
        rule("speed", "KILL" if kill else "ok",
             "; ".join(kill) or "candidate within the controls' spread (or faster) on every speed cell",
             cells={c: {k: v[k] for k in ("basis", "candidate_ratio", "kill_below")} for c, v in per_cell.items()}),
    ]


def speed_basis(cell: str, *boots: dict) -> str:
    """What a speed cell is judged on: output tokens per server CPU-second when every boot recorded
    them (the gate ran on the servers' machine, `--server-pid`), else tokens per wall-second.
    Boots measured at different times on a shared machine see different load: their wall-clock
    rates swing up to ~3x (a KILL of an equal line, issue 40), their CPU cost per token far less."""
    if all("cpu_tok_s_reps" in d["cells"][cell] for d in boots):
        return "cpu_tok_s_reps"
    return "tok_s_reps"


def t0_outputs(d: dict) -> dict:
    """id -> (text, tokens) of the T=0 prompt set, plus the resume cell's three T=0 answers."""
    out = {s["id"]: (s["text"], tuple(s.get("tokens") or ())) for s in d["samples"]["t0"]}
    for step, text in (d["cells"]["resume"].get("texts") or {}).items():
        out[f"resume-{step}"] = (text, ())
    return out


def t0_rules(a: dict, b: dict, a2: dict, max_excluded: Optional[int]) -> list[dict]:
    oa, ob, oa2 = t0_outputs(a), t0_outputs(b), t0_outputs(a2)
    ids = sorted(oa)
    excluded = [i for i in ids if oa[i] != oa2.get(i)]
    agreed = [i for i in ids if i not in excluded]
    allowed = max_excluded if max_excluded is not None else max(1, len(ids) // 10)
    differ = [i for i in agreed if ob.get(i) != oa[i]]
    diffs = {i: {"controls": oa[i][0], "candidate": (ob.get(i) or ("",))[0]} for i in differ}
    return [
        rule("controls.t0", "INVALID" if len(excluded) > allowed else "ok",
             f"controls differ on {len(excluded)} of {len(ids)} prompts (at most {allowed} may be excluded)"
             + (f": {', '.join(excluded)}" if excluded else ""),
             prompts=len(ids), excluded=excluded, max_excluded=allowed),
        rule("t0", "KILL" if differ else "ok",
             (f"candidate differs on {len(differ)} of {len(agreed)} prompts the controls agree on: "
              f"{', '.join(differ)}") if differ else
             f"candidate equal on {len(agreed)} of {len(agreed)} prompts the controls agree on",
             agreed=len(agreed), equal=len(agreed) - len(differ), differ=differ, diffs=diffs),
    ]


def position_kl(p_top: dict, q_top: dict) -> float:
    """KL(P || Q) at one position from top-k logprobs: bins are P's top-k tokens and the rest.
    A token missing from Q's top-k gets at most Q's k-th probability and a share of Q's tail.
    Coarse-graining can only lower KL: this is a lower estimate, exact as the tails vanish."""
    keys = list(p_top)
    p = np.exp(np.array([p_top[k] for k in keys], dtype=float))
    q_known = {k: math.exp(v) for k, v in q_top.items()}
    q_tail = max(0.0, 1.0 - sum(q_known.values()))
    q_min = min(q_known.values()) if q_known else 1.0
    missing = [k for k in keys if k not in q_known]
    share = min(q_min, q_tail / len(missing)) if missing else 0.0
    q = np.array([q_known.get(k, share) for k in keys], dtype=float)
    p_rest, q_rest = max(0.0, 1.0 - p.sum()), max(0.0, 1.0 - q.sum())
    p_all = np.append(p, p_rest)
    q_all = np.maximum(np.append(q, q_rest), EPS)
    p_all, q_all = p_all / p_all.sum(), q_all / q_all.sum()
    nz = p_all > 0
    return float(max(0.0, np.sum(p_all[nz] * np.log(p_all[nz] / q_all[nz]))))


def prompt_kl(p_sample: dict, q_sample: dict) -> list[float]:
    if p_sample["tokens"] != q_sample["tokens"] or p_sample["positions"] != q_sample["positions"]:
        raise C.GateError(f"KL prompt {p_sample['id']}: the boots tokenised it differently "
                          f"(another tokenizer?): KL is undefined")
    return [position_kl(p, q) for p, q in zip(p_sample["top"], q_sample["top"])]


def kld_table(a: dict, b: dict, a2: dict) -> dict:
    """Per prompt: group, mean KL of (A||B), (A2||B), (A||A2), and the per-position values."""
    sb = {s["id"]: s for s in b["samples"]["kld"]}
    sa2 = {s["id"]: s for s in a2["samples"]["kld"]}
    out = {}
    for s in a["samples"]["kld"]:
        pairs = {"A||B": prompt_kl(s, sb[s["id"]]), "A2||B": prompt_kl(sa2[s["id"]], sb[s["id"]]),
                 "A||A2": prompt_kl(s, sa2[s["id"]])}
        out[s["id"]] = {"group": s["group"], "positions": len(s["positions"]), "values": pairs,
                        **{k: float(np.mean(v)) if v else 0.0 for k, v in pairs.items()}}
    return out


def kld_rule(a: dict, b: dict, a2: dict, reference: dict) -> tuple[dict, dict]:
    table = kld_table(a, b, a2)
    groups, kill = {}, []
    for g in ("long", "short"):
        rows = [r for r in table.values() if r["group"] == g]
        if not rows:
            continue
        pooled = {k: [x for r in rows for x in r["values"][k]] for k in ("A||B", "A2||B", "A||A2")}
        cand = float(np.mean(pooled["A||B"] + pooled["A2||B"]))
        ctrl = float(np.mean(pooled["A||A2"]))
        threshold = max(reference[g], KLD_FACTOR * ctrl)
        groups[g] = {"candidate": cand, "controls": ctrl, "reference": reference[g], "threshold": threshold,
                     "positions": len(pooled["A||A2"])}
        if cand > threshold:
            kill.append(f"{g} {cand:.4g} > {threshold:.4g}")
    why = ("KL(control || candidate) " + "; ".join(kill)) if kill else "KL within thresholds: " + ", ".join(
        f"{g} {v['candidate']:.3g} <= {v['threshold']:.3g}" for g, v in groups.items())
    per_prompt = {i: {k: r[k] for k in ("group", "positions", "A||B", "A2||B", "A||A2")} for i, r in table.items()}
    return rule("kld", "KILL" if kill else "ok", why, groups=groups, factor=KLD_FACTOR,
                per_prompt=per_prompt), table


def two_sample_test(x: list, y: list) -> dict:
    """Chi-square test of homogeneity of two samples of first tokens (scipy.stats.chi2_contingency);
    categories too rare for the test are merged into one, until every expected count is >= 5."""
    from scipy.stats import chi2_contingency

    cats = sorted(set(x) | set(y))
    cx = {c: 0 for c in cats}
    cy = dict(cx)
    for v in x:
        cx[v] += 1
    for v in y:
        cy[v] += 1
    n, small_row = len(x) + len(y), min(len(x), len(y))
    if small_row == 0:
        raise C.GateError("T=1 cell with no samples")
    totals = {c: cx[c] + cy[c] for c in cats}
    keep = [c for c in cats if totals[c] * small_row / n >= MIN_EXPECTED]
    rest = [c for c in cats if c not in keep]
    table = [[cx[c] for c in keep], [cy[c] for c in keep]]
    if rest:
        rx, ry = sum(cx[c] for c in rest), sum(cy[c] for c in rest)
        if (rx + ry) * small_row / n >= MIN_EXPECTED or not keep:
            table[0].append(rx)
            table[1].append(ry)
        else:                       # too small alone: fold into the rarest kept category
            j = min(range(len(keep)), key=lambda k: totals[keep[k]])
            table[0][j] += rx
            table[1][j] += ry
    if len(table[0]) < 2:
        return {"p": 1.0, "chi2": 0.0, "dof": 0, "categories": len(table[0]), "distinct": len(cats)}
    res = chi2_contingency(np.array(table))
    return {"p": float(res.pvalue), "chi2": float(res.statistic), "dof": int(res.dof),
            "categories": len(table[0]), "distinct": len(cats)}


def t1_rules(a: dict, b: dict, a2: dict, alpha: float) -> list[dict]:
    sa = {s["id"]: s["first_tokens"] for s in a["samples"]["t1"]}
    sb = {s["id"]: s["first_tokens"] for s in b["samples"]["t1"]}
    sa2 = {s["id"]: s["first_tokens"] for s in a2["samples"]["t1"]}
    per_alpha = alpha / max(1, len(sa))                     # Bonferroni over the prompts
    controls, candidate = {}, {}
    for i in sa:
        controls[i] = two_sample_test(sa[i], sa2[i])
        candidate[i] = two_sample_test(sb[i], sa[i] + sa2[i])
    bad_c = [i for i, r in controls.items() if r["p"] < per_alpha]
    bad_b = [i for i, r in candidate.items() if r["p"] < per_alpha]
    fmt = lambda rs, ids: ", ".join(f"{i} p={rs[i]['p']:.2g}" for i in ids)  # noqa: E731
    return [
        rule("controls.t1", "INVALID" if bad_c else "ok",
             (f"controls' T=1 distributions differ: {fmt(controls, bad_c)} < {per_alpha:.2g}") if bad_c else
             f"controls alike (min p {min(r['p'] for r in controls.values()):.2g} >= {per_alpha:.2g})",
             alpha=alpha, per_prompt_alpha=per_alpha, tests=controls),
        rule("t1", "KILL" if bad_b else "ok",
             (f"candidate's T=1 distribution differs from the pooled controls': {fmt(candidate, bad_b)} "
              f"< {per_alpha:.2g}") if bad_b else
             f"candidate alike (min p {min(r['p'] for r in candidate.values()):.2g} >= {per_alpha:.2g})",
             alpha=alpha, per_prompt_alpha=per_alpha, tests=candidate,
             samples={i: [len(sa[i]), len(sb[i]), len(sa2[i])] for i in sa}),
    ]


def needle_rules(a: dict, b: dict, a2: dict) -> list[dict]:
    na, nb, na2 = (d["cells"]["needle"] for d in (a, b, a2))
    figs = dict(found=[na["found"], nb["found"], na2["found"]], prompt_tokens=nb.get("prompt_tokens"),
                ttft_s=[na.get("ttft_s"), nb.get("ttft_s"), na2.get("ttft_s")])
    if na["found"] != na2["found"]:
        return [rule("controls.needle", "INVALID", "one control found the needle and the other did not", **figs),
                rule("needle", "n/a", "controls disagree", **figs)]
    ctrl = rule("controls.needle", "ok", f"both controls {'found' if na['found'] else 'lost'} it", **figs)
    if na["found"]:
        return [ctrl, rule("needle", "ok" if nb["found"] else "KILL",
                           f"needle {'found' if nb['found'] else 'lost'} by the candidate at "
                           f"{nb.get('prompt_tokens')} tokens (the controls found it)", **figs)]
    if na["text"] != na2["text"]:
        return [ctrl, rule("needle", "n/a", "the controls lost it and their answers differ", **figs)]
    same = nb["text"] == na["text"]
    return [ctrl, rule("needle", "ok" if same else "KILL",
                       "the controls lost it (the model cannot retrieve it); the candidate's T=0 answer "
                       + ("equals theirs" if same else f"differs: {nb['text']!r} vs {na['text']!r}"), **figs)]


def soak_rules(a: dict, b: dict, a2: dict) -> list[dict]:
    def failed(d):
        s = d["cells"]["soak"]
        return int(s["failures"]) + int(s["companion_failures"])

    fa, fb, fa2 = failed(a), failed(b), failed(a2)
    reqs = [d["cells"]["soak"]["requests"] for d in (a, b, a2)]
    lines = b["cells"]["soak"].get("failure_lines") or []
    return [rule("controls.soak", "INVALID" if fa or fa2 else "ok",
                 f"control soak failures {fa} / {fa2}", failures=[fa, fa2], requests=[reqs[0], reqs[2]]),
            rule("soak", "KILL" if fb else "ok",
                 f"candidate soak: {fb} failed of {reqs[1]} requests"
                 + (f" ({lines[0]})" if lines else ""), failures=fb, requests=reqs[1], failure_lines=lines[:5])]


def resume_figures(a: dict, b: dict, a2: dict) -> dict:
    """Not a rule (docs/gate.md): the evicted resume's TTFT and cached tokens, for the report; its
    T=0 answers are part of the T=0 rule."""
    keys = ("cold_ttft_s", "warm_ttft_s", "evicted_ttft_s", "warm_cached_tokens", "evicted_cached_tokens")
    return {lb: {k: d["cells"]["resume"].get(k) for k in keys} for lb, d in zip(("A", "B", "A2"), (a, b, a2))}


# --- judging ---------------------------------------------------------------------------------

def settings(args) -> dict:
    s = dict(DEFAULTS)
    for k in DEFAULTS:
        v = getattr(args, k, None)
        if v is not None:
            s[k] = v
    if s["speed_floor"] < 0 or s["t1_alpha"] <= 0 or s["t1_alpha"] >= 1 or s["kld_long"] < 0 or s["kld_short"] < 0:
        raise C.GateError("thresholds: --speed-floor >= 0, 0 < --t1-alpha < 1, --kld-* >= 0")
    if s["max_excluded"] is not None and s["max_excluded"] < 0:
        raise C.GateError("--max-excluded must be >= 0")
    return s


def judge(run_dir, order: str, **overrides) -> dict:
    """The verdict of one A/B/A as a JSON-ready dict (raises GateError when it cannot judge)."""
    import argparse

    s = settings(argparse.Namespace(**overrides))
    ca, cb, ca2 = parse_order(order)
    data = load_run(run_dir, (ca, cb, ca2))
    a, b, a2 = data[ca], data[cb], data[ca2]
    kld, table = kld_rule(a, b, a2, {"long": s["kld_long"], "short": s["kld_short"]})
    rules = [*speed_rules(a, b, a2, s["speed_floor"]), *t0_rules(a, b, a2, s["max_excluded"]), kld,
             *t1_rules(a, b, a2, s["t1_alpha"]), *needle_rules(a, b, a2), *soak_rules(a, b, a2)]
    outcomes = [r["outcome"] for r in rules]
    verdict = "INVALID" if "INVALID" in outcomes else "KILL" if "KILL" in outcomes else "PASS"
    decided = [r["rule"] for r in rules if r["outcome"] == verdict] if verdict != "PASS" else []
    return {"verdict": verdict, "decided_by": decided, "run_dir": str(run_dir),
            "order": {"control": ca, "candidate": cb, "control2": ca2},
            "suite": a["meta"]["suite"], "model": a["meta"]["model"], "settings": s,
            "rules": rules, "resume": resume_figures(a, b, a2),
            "_data": data, "_kld_table": table}


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def format_text(result: dict) -> str:
    o = result["order"]
    by = f" (by {', '.join(result['decided_by'])})" if result["decided_by"] else ""
    lines = [f"dsv41 gate verdict {result['run_dir']}: {o['control']} / {o['candidate']} / {o['control2']} "
             f"({result['suite']} suite, model {result['model']})", f"verdict: {result['verdict']}{by}"]
    width = max(len(r["rule"]) for r in result["rules"])
    for r in result["rules"]:
        lines.append(f"  {r['rule']:{width}s}  {r['outcome']:7s}  {r['why']}")
    if result.get("report"):
        lines.append(f"report: {result['report']}")
    return "\n".join(lines)


def main(args) -> int:
    from adapter.tools.gate import report

    try:
        result = judge(args.run_dir, args.order, **{k: getattr(args, k, None) for k in DEFAULTS})
    except C.GateError as exc:
        print(f"dsv41 gate verdict: {exc}", file=sys.stderr)
        return 2
    out = pathlib.Path(args.run_dir)
    try:
        paths = report.write(result, out)
        result["report"] = str(paths["report"])
    except OSError as exc:
        print(f"dsv41 gate verdict: report not written: {exc}", file=sys.stderr)
    body = public(result)
    (out / "verdict.json").write_text(json.dumps(body, indent=1, default=str) + "\n")
    print(json.dumps(body, indent=1, default=str) if args.json else format_text(result))
    return EXIT[result["verdict"]]
