"""`dsv41 calibrate yield`: fit decode yield's cost model to the operator's own engine.

Input: the scheduler log of a running engine (the process `sglang::scheduler_TP0`; on the cluster
the container's log). sglang 0.5.23 prints, from its result processing
(`scheduler_components/metrics_reporter.py`):

    [ts] Prefill batch[ [iter]], #new-seq: N, #new-token: N, #cached-token: N, <usage>, #running-req: N,
         #queue-req: N, #pending-token: N, [#replay-token: N, ]<graph>: B, input throughput (token/s): X
    [ts] Decode batch[ [iter]], #running-req: N, <usage>, <graph>: B, gen throughput (token/s): X, #queue-req: N

(`<usage>` is `#token: N, token usage: X` on a dense pool, `#full token: N, full token usage: X,
#swa token: N, swa token usage: X` on a hybrid-SWA one; ` [iter]` only with
SGLANG_LOG_FORWARD_ITERS=1). Each throughput is a count over the time since the previous line of
its kind, so the log gives durations without reading its timestamps:

- chunk samples: a prefill line that continues the previous prefill line's prompt (its
  `#pending-token` went down by exactly this line's `#new-token`, one new sequence, nothing in the
  queue) with no decode rows running (`#running-req: 0`, so no decode forward ran between the two):
  gap = (#new-token + #replay-token) / input throughput. The engine logs a batch when it
  processes its result. Whether the gap is this chunk's forward or the next one's depends on the
  loop (`logged_after`): told from each prompt's last chunk, whose line comes at once after the
  one before it when the next forward ran before the result was read (seen on the CPU server's
  hybrid-SWA model; its dense model logs each chunk after its own forward).
- step samples: a decode line after a decode line with no prefill line between and the same
  `#running-req`: gap = rows x steps / gen throughput, steps = the iter difference when the log
  has iters, else --decode-log-interval (the engine's default 40; checked against the lines'
  own timestamps).

Model (adapter/decode_yield.py, seconds): chunk = a + b·L + c·L·(P + L/2) + g·P² for L new
tokens after P cached (g = 0: a chunk whose attention reads what it sees, c·L·(P + L/2); g = c/2:
(c/2)·(P + L)², a backend whose chunk cost grows with the whole context squared; the fit picks); step = d + e·rows + f·context (context: the decode line's #token / #full token,
which is the rows' context when the radix cache holds little else: flush it before a
calibration run). Fitted by non-negative least squares (scipy.optimize.lsq_linear): chunks in
seconds, so the long chunks that hold most of a prefill's time are fitted best (a share is a
share of time); steps on relative residuals, every decode condition weighing alike. A term whose feature does not vary in the log is not identifiable,
is set to 0 and said so. Printed: the constants, residuals, and the profile value
DSV41_DECODE_YIELD_MODEL=<chunk_fixed_us,chunk_token_ns,chunk_pair_ps,step_fixed_us,step_row_us,
step_ctx_ps[,chunk_prefix_sq_ps]> (the seventh only when not 0).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import re
import sys
from typing import Optional

LINE_RE = re.compile(r"\[(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)(?P<who>[^\]]*)\] "
                     r"(?P<kind>Prefill|Decode) batch(?: \[(?P<iter>\d+)\])?, (?P<rest>.*)$")
FIELD_RE = re.compile(r"([^,:]+): ([^,]+)")
DEFAULT_DECODE_LOG_INTERVAL = 40          # sglang 0.5.23's --decode-log-interval default
VARIES = 0.01                             # a feature whose spread is below 1 % is not identifiable
MIN_SAMPLES = 3
WARN_RESIDUAL = 0.25                      # rms relative residual above which the form is said to miss


class CalibrationError(Exception):
    """The logs cannot give a fit; the message says what to send or pass."""


@dataclasses.dataclass
class Line:
    kind: str                  # "Prefill" | "Decode"
    ts: datetime.datetime
    who: str                   # text after the timestamp inside [...] (" TP0", "" on one rank)
    iter: Optional[int]
    fields: dict
    source: str                # file:line

    def num(self, name: str, default: Optional[float] = None) -> float:
        if name in self.fields:
            return float(self.fields[name])
        if default is None:
            raise CalibrationError(f"{self.source}: a {self.kind} batch line without {name!r}: "
                                   f"not sglang 0.5.23's format")
        return default


def parse_line(text: str, source: str = "") -> Optional[Line]:
    """One engine log line -> Line, or None when it is not a Prefill/Decode batch line."""
    m = LINE_RE.search(text.rstrip("\n"))
    if m is None:
        return None
    fmt = "%Y-%m-%d %H:%M:%S.%f" if "." in m["ts"] else "%Y-%m-%d %H:%M:%S"
    fields = {k.strip(): v.strip() for k, v in FIELD_RE.findall(m["rest"])}
    return Line(m["kind"], datetime.datetime.strptime(m["ts"], fmt), m["who"].strip(),
                int(m["iter"]) if m["iter"] else None, fields, source)


def read_lines(paths) -> list[list[Line]]:
    """Per log file and per logging rank (the [..] prefix), the batch lines in order."""
    streams = []
    for path in paths:
        try:
            text = pathlib.Path(path).read_text(errors="replace")
        except OSError as exc:
            raise CalibrationError(f"cannot read {path}: {exc}") from None
        by_who: dict[str, list[Line]] = {}
        for n, raw in enumerate(text.splitlines(), 1):
            line = parse_line(raw, f"{path}:{n}")
            if line is not None:
                by_who.setdefault(line.who, []).append(line)
        streams.extend(by_who.values())
    return streams


def _context(line: Line) -> float:
    if "#token" in line.fields:
        return line.num("#token")
    return line.num("#full token")      # hybrid SWA pool: the full-attention context


def chunk_chains(lines: list[Line]) -> list[list[tuple]]:
    """The prompts prefilled alone in one stream, each as its chunk lines [(L, P, gap s, source)]:
    the first chunk (its gap also holds the idle time before it: never a sample), then every line
    that continues it."""
    chains, prev = [], None
    for i, ln in enumerate(lines):
        if ln.kind != "Prefill":
            continue
        new = ln.num("#new-token")
        continues = (prev is not None and lines[i - 1] is prev and chains   # no decode line between
                     and ln.num("#new-seq") == 1 and prev.num("#new-seq") == 1
                     and ln.num("#running-req") == 0 and prev.num("#running-req") == 0
                     and ln.num("#queue-req") == 0 and prev.num("#pending-token") > 0
                     and prev.num("#pending-token") - new == ln.num("#pending-token"))
        thr = ln.num("input throughput (token/s)")
        gap = (new + ln.num("#replay-token", 0.0)) / thr if thr > 0 else float("nan")
        if continues:
            L0, P0, _, _ = chains[-1][-1]
            # the engine logs #cached-token at admission only: a continuing chunk's prefix is the
            # chain's cached start plus every chunk before it
            chains[-1].append((new, P0 + L0, gap, ln.source))
        else:
            chains.append([(new, ln.num("#cached-token"), gap, ln.source)])
        prev = ln
    return [c for c in chains if len(c) > 1]


def logged_after(chains) -> tuple[int, str]:
    """Which forward a chunk line's gap timed: 0 = its own (the engine processes a result once
    its forward is done and nothing runs ahead, as on a GPU's overlap loop), 1 = the next one
    (an overlap loop whose forward runs synchronously: the next chunk's forward is launched
    before this result is read). Told by the prompt's last chunk: with 1 its line follows the
    one before it at once (no chunk after it), with 0 its gap is a chunk's forward. Prompts whose
    last chunk is shorter than half the one before it do not vote."""
    votes = []
    for chain in chains:
        if len(chain) < 3:
            continue
        (L_prev, _, g_prev, _), (L_last, _, g_last, _) = chain[-2], chain[-1]
        if L_last >= L_prev / 2 and g_prev > 0:
            votes.append(1 if g_last < 0.2 * g_prev else 0)
    if not votes:
        return 0, "no prompt with 3 chunks and a full last chunk to tell: assumed 0"
    shift = int(sum(votes) * 2 > len(votes))
    return shift, f"{votes.count(shift)} of {len(votes)} prompts' last chunk"


def chunk_samples(chains, shift: int) -> list[tuple]:
    """[(L, P, seconds, source)]: each continuing line's gap, given to the forward it timed."""
    out = []
    for chain in chains:
        for k in range(1, len(chain)):
            if shift == 0:
                L, P, _, _ = chain[k]
            elif k + 1 < len(chain):
                L, P, _, _ = chain[k + 1]
            else:
                continue         # the last line's gap timed what came after the prompt
            out.append((L, P, chain[k][2], chain[k][3]))
    return out


def step_samples(lines: list[Line], interval: int) -> list[tuple]:
    """[(rows, context, seconds per step, source, seconds by timestamps)] of one stream."""
    out = []
    for i in range(1, len(lines)):
        ln, prev = lines[i], lines[i - 1]
        if ln.kind != "Decode" or prev.kind != "Decode":
            continue
        rows = ln.num("#running-req")
        thr = ln.num("gen throughput (token/s)")
        if rows <= 0 or thr <= 0 or rows != prev.num("#running-req"):
            continue
        steps = interval
        if ln.iter is not None and prev.iter is not None:
            steps = ln.iter - prev.iter
            if steps <= 0:
                continue
        seconds = rows * steps / thr
        out.append((rows, _context(ln), seconds / steps, ln.source,
                    (ln.ts - prev.ts).total_seconds(), seconds))
    return out


def _fit(features, targets, names, relative: bool):
    """Non-negative least squares, on relative residuals or on seconds; unidentifiable columns
    fixed at 0."""
    import numpy as np
    from scipy.optimize import lsq_linear

    X = np.asarray(features, dtype=float)
    y = np.asarray(targets, dtype=float)
    keep, dropped = [0], []
    for col in range(1, X.shape[1]):
        values = X[:, col]
        spread = (values.max() - values.min()) / max(abs(values).max(), 1e-30)
        (keep if spread >= VARIES else dropped).append(col)
    w = 1.0 / y if relative else np.ones_like(y)
    A = X[:, keep] * w[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    sol = lsq_linear(A / scale, y * w, bounds=(0.0, np.inf), method="bvls")
    coef = np.zeros(X.shape[1])
    coef[keep] = sol.x / scale
    rel = (X @ coef - y) / y
    return {"coef": [float(c) for c in coef], "dropped": [names[c] for c in dropped],
            "objective": float(np.sum(((X @ coef - y) * w) ** 2)),
            "rms_rel_residual": float(np.sqrt(np.mean(rel ** 2))),
            "max_rel_residual": float(np.max(np.abs(rel))), "rel_residuals": [float(r) for r in rel]}


def fit(paths, decode_log_interval: Optional[int] = None) -> dict:
    """The fit of the logs at `paths`; raises CalibrationError with what is missing."""
    from adapter import decode_yield, keys

    interval = decode_log_interval or DEFAULT_DECODE_LOG_INTERVAL
    streams = read_lines(paths)
    n_pre = sum(ln.kind == "Prefill" for s in streams for ln in s)
    n_dec = sum(ln.kind == "Decode" for s in streams for ln in s)
    if not n_pre and not n_dec:
        raise CalibrationError(f"no 'Prefill batch' / 'Decode batch' lines in {', '.join(map(str, paths))}: "
                               f"pass the scheduler's log (process sglang::scheduler_TP0)")
    chains, steps = [], []
    for s in streams:
        chains.extend(chunk_chains(s))
        steps.extend(step_samples(s, interval))
    shift, shift_why = logged_after(chains)
    chunks = chunk_samples(chains, shift)
    if len(chunks) < MIN_SAMPLES:
        raise CalibrationError(
            f"{len(chunks)} chunk samples (need {MIN_SAMPLES}): the log needs a prompt of at "
            f"least {MIN_SAMPLES + 2} chunks prefilled while no decode row runs (#running-req: 0); "
            f"send one long prompt alone (docs/decode_yield.md, 'Calibrate')")
    if len(steps) < MIN_SAMPLES:
        raise CalibrationError(
            f"{len(steps)} decode step samples (need {MIN_SAMPLES}): the log needs decode lines in a row "
            f"with the same #running-req and no prefill between; run a few streams alone for "
            f"{MIN_SAMPLES + 1} x --decode-log-interval steps (docs/decode_yield.md, 'Calibrate')")
    has_iters = any(ln.iter is not None for s in streams for ln in s if ln.kind == "Decode")
    timed = [(s[4], s[5]) for s in steps]
    by_ts, by_thr = sum(t for t, _ in timed), sum(g for _, g in timed)
    if not has_iters and by_ts >= 10 and not 0.75 <= by_thr / by_ts <= 1.33:
        raise CalibrationError(
            f"the decode lines' throughputs with {interval} steps per line give {by_thr:.1f} s, "
            f"their timestamps {by_ts:.1f} s: the engine logged every N != {interval} steps; "
            f"pass its --decode-log-interval as --decode-log-interval N")

    chunk_fit = _fit([(1.0, L, L * (P + L / 2), P * P) for L, P, _, _ in chunks],
                     [t for _, _, t, _ in chunks],
                     ("fixed", "per token", "per pair", "per squared prefix token"), relative=False)
    step_fit = _fit([(1.0, r, c) for r, c, *_ in steps], [s[2] for s in steps],
                    ("fixed", "per row", "per context token"), relative=True)
    a, b, c, g = chunk_fit["coef"]
    d, e, f = step_fit["coef"]
    model = decode_yield.CostModel(round(a * 1e6), round(b * 1e9), round(c * 1e12),
                                   max(1, round(d * 1e6)), round(e * 1e6), round(f * 1e12),
                                   round(g * 1e12))
    key = keys.KEY_BY_NAME[decode_yield.MODEL_KEY]
    try:
        keys.parse_env({key.name: model.value()})     # the value must pass the boot check as printed
    except keys.ConfigError as exc:
        raise CalibrationError(f"the fit is outside what the adapter accepts: {exc}") from None
    median_L = int(sorted(s[0] for s in chunks)[len(chunks) // 2])
    warnings = [f"{part} cost: rms relative residual {fitted['rms_rel_residual']:.0%} > "
                f"{WARN_RESIDUAL:.0%}: this engine's {part} times do not follow the model's form "
                f"({form}); the achieved share will differ from the configured one (see --plot)"
                for part, fitted, form in (("chunk", chunk_fit, "a + b*L + c*L*(P + L/2) + g*P^2"),
                                           ("step", step_fit, "d + e*rows + f*context"))
                if fitted["rms_rel_residual"] > WARN_RESIDUAL]
    return {
        "warnings": warnings,
        "logs": [str(p) for p in paths],
        "lines": {"prefill": n_pre, "decode": n_dec},
        "model": model._asdict(),
        "value": model.value(),
        "profile_line": f"{decode_yield.MODEL_KEY}={model.value()}",
        "chunk": {"samples": len(chunks), "logged_after": shift, "logged_after_by": shift_why,
                  "rms_s": (chunk_fit["objective"] / len(chunks)) ** 0.5,
                  "rms_rel_residual": chunk_fit["rms_rel_residual"],
                  "max_rel_residual": chunk_fit["max_rel_residual"],
                  "not_identifiable": chunk_fit["dropped"],
                  "points": [{"L": L, "P": P, "s": t, "fit_s": t * (1 + r), "line": src}
                             for (L, P, t, src), r in zip(chunks, chunk_fit["rel_residuals"])]},
        "step": {"samples": len(steps), "steps_per_line": "iters" if has_iters else interval,
                 "rms_rel_residual": step_fit["rms_rel_residual"],
                 "max_rel_residual": step_fit["max_rel_residual"],
                 "not_identifiable": step_fit["dropped"],
                 "seconds_by_throughput": round(by_thr, 3), "seconds_by_timestamps": round(by_ts, 3),
                 "points": [{"rows": r, "context": cx, "s": t, "fit_s": t * (1 + res), "line": src}
                            for (r, cx, t, src, *_), res in zip(steps, step_fit["rel_residuals"])]},
        "plans": {share: decode_yield.yield_steps(
            share, decode_yield.pass_cost_us([median_L], [0], model),
            decode_yield.step_cost_us(2, 2 * 4096, model), 1) for share in (33, 50)},
        "plans_for": f"a {median_L}-token chunk at prefix 0 beside 2 rows of 4096 context",
    }


def format_report(r: dict) -> str:
    m = r["model"]
    ch, st = r["chunk"], r["step"]
    out = [f"logs: {', '.join(r['logs'])} ({r['lines']['prefill']} prefill, {r['lines']['decode']} decode lines)",
           f"chunk cost: {m['chunk_fixed_us']} us + {m['chunk_token_ns']} ns/token + {m['chunk_pair_ps']} ps/pair "
           f"+ {m['chunk_prefix_sq_ps']} ps/squared prefix token "
           f"({ch['samples']} samples, gap = forward +{ch['logged_after']} ({ch['logged_after_by']}), residual rms {ch['rms_rel_residual']:.1%}, "
           f"max {ch['max_rel_residual']:.1%})",
           f"step cost:  {m['step_fixed_us']} us + {m['step_row_us']} us/row + {m['step_ctx_ps']} ps/context token "
           f"({st['samples']} samples, residual rms {st['rms_rel_residual']:.1%}, max {st['max_rel_residual']:.1%})"]
    for part, fitted in (("chunk", ch), ("step", st)):
        if fitted["not_identifiable"]:
            out.append(f"  {part}: {', '.join(fitted['not_identifiable'])} not identifiable from these "
                       f"logs (feature does not vary): 0, folded into the fixed term")
    out.extend(f"warning: {w}" for w in r["warnings"])
    out.append(f"plans: share 33 -> {r['plans'][33]} decode steps, share 50 -> {r['plans'][50]} for "
               f"{r['plans_for']} (cap 128)")
    out.append("")
    out.append("profile value (add to EXTRA_CONTAINER_ENV beside DSV41_DECODE_YIELD):")
    out.append(f"  {r['profile_line']}")
    return "\n".join(out)


def plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    pts = r["chunk"]["points"]
    ax1.scatter([p["P"] for p in pts], [p["s"] for p in pts], label="log", color="tab:blue")
    ax1.scatter([p["P"] for p in pts], [p["fit_s"] for p in pts], label="fit", marker="x", color="tab:red")
    ax1.set(xlabel="prefix tokens P", ylabel="chunk forward (s)",
            title=f"chunk cost (rms {r['chunk']['rms_rel_residual']:.1%})")
    ax1.legend()
    pts = r["step"]["points"]
    ax2.scatter([p["context"] for p in pts], [1e3 * p["s"] for p in pts], label="log", color="tab:blue")
    ax2.scatter([p["context"] for p in pts], [1e3 * p["fit_s"] for p in pts], label="fit", marker="x",
                color="tab:red")
    ax2.set(xlabel="decode context tokens", ylabel="decode step (ms)",
            title=f"step cost (rms {r['step']['rms_rel_residual']:.1%})")
    ax2.legend()
    fig.suptitle(r["profile_line"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(args) -> int:
    if args.what != "yield":
        print(f"dsv41 calibrate: unknown target {args.what!r} (yield)", file=sys.stderr)
        return 2
    try:
        result = fit(args.log, args.decode_log_interval)
    except CalibrationError as exc:
        print(f"dsv41 calibrate yield: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    print(json.dumps(result, indent=1) if args.json else format_report(result))
    return 0
