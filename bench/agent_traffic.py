"""The release's headline effects as ratios, measured by the engine's own benchmark client on
agent traffic (issue 32).

    .venv/bin/python bench/agent_traffic.py [--cpu-model swa] [--boots 2] [--seed N]
                                            [--yield-model V] [--out DIR]
    .venv/bin/python bench/agent_traffic.py --cpu-model dsv4 --scale knobs --yield-model V \
        --lines stock line pdi8 pdi16 mixed half stock384 swapool thin128 thin384

--lines (issue 43): the lines to boot, in that order, --boots rounds of them; besides stock and
line, lines that differ from stock by exactly one engine knob or are one of ours
(adapter/tools/agent_traffic.py KNOB_LINES). Any other set than the default "stock line" adds the
knobs table: one row per line, each figure per boot and over stock's median, the full and SWA pool
sizes the engine logged per boot, the full-pool tokens a resumed session holds and the pool's
capacity in such sessions. Scale "knobs" (dsv4) leaves the pools to the engine's own sizing
(tails-based cap mode, a fixed KV budget: adapter/cpu/pool_budget.py), where the tails trade full
KV for SWA slots; the other scales set an operator --swa-full-tokens-ratio, under which
--swa-prefix-tails sizes nothing.

Writes one seeded trace in `sglang.bench_serving`'s own dataset formats (agentic-trace
conversations, mooncake timed records, random-ids; adapter/tools/agent_traffic.py: no download),
then boots the stock line and the production line of .env.tp4.example alternately (stock, line,
stock, line: --boots each), each a real SGLang server on this CPU (adapter/cpu/server.py) with
the same launch arguments, and replays the trace against each with the client; the rows come from
the client's own --output-file JSON (per-request ttft, itl, cached_tokens, prompt tokens) and, for
the T=0 output ids, from the engine's own request log.

  stock = no DSV41 keys, the control line's kept launch args (--swa-prefix-tails 128,
          --prefill-decode-interval 1);
  line  = the production line's DSV41 keys and kept args (adapter/tools/canary.py split_line,
          as the canary uses them), plus DSV41_DECODE_YIELD_MODEL = the operator's fitted cost
          model: `dsv41 calibrate yield`'s fit (adapter/tools/calibrate.py) of the calibration
          traffic's scheduler log, sent to the first stock boot after its measured traffic
          (or --yield-model V); none when the line has DSV41_DECODE_YIELD_ONLINE=1 (decode yield
          then scales its model from the engine's own step timings) and no --yield-model is given.

Each effect is read where its adapter acts: thin's (and cone's, on DeepSeek-V4) on the resumed
turns, decode yield's on the streams beside a long prefill, the line's cost on short traffic.
On the hybrid-SWA tiny model ("swa") cone declines (no DeepSeek-V4 backend): the resume effect
there is thin's. Prints one row per figure (per-boot spread in brackets, the cluster's figure
beside it), one line per goal ("met" / "missed" with the numbers), the profile of a missed
goal, and writes a JSON file with every row (--out, default runs/agent_traffic/<time>/).
Progress lines go to stderr. docs/performance.md holds a run's table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from adapter.tools import agent_traffic as at  # noqa: E402

PROFILE = REPO_ROOT / ".env.tp4.example"
LOST = 0.5            # a resumed turn with less of its prompt cached than this lost its window

# Goals (issue 32), as ratios measured in one run.
GOAL_RESUME_TTFT = 5.0          # stock / line, TTFT p50 of resumed turns whose window stock lost
GOAL_RESUME_CACHED = 0.9        # line's cached fraction on those turns
GOAL_ITL_P99 = 2.0              # stock / line, ITL p99 of streams while a long prompt prefills
GOAL_LONG_TTFT = 1.5            # line / stock, the long prompt's TTFT
GOAL_THROUGHPUT = 0.98          # line / stock, short traffic
GOAL_SHORT_TTFT = 1.03          # line / stock, short traffic TTFT p50
DEFAULT_LINES = ("stock", "line")


def lines(profile_path, yield_model=None, model="swa"):
    """stock and line keys / args; the line's keys scaled to the CPU model as the canary scales
    them (canary.model_keys: cone's N on dsv4)."""
    from adapter.tools import canary, profile

    prod_keys, prod_args, _ = canary.split_line(profile.load_line(profile_path, "production"))
    _, ctrl_args, _ = canary.split_line(profile.load_line(profile_path, "control"))
    line_keys = dict(canary.model_keys(model, prod_keys)[0])
    if yield_model:
        line_keys["DSV41_DECODE_YIELD_MODEL"] = yield_model
    return {"stock": {"keys": {}, "args": dict(ctrl_args)}, "line": {"keys": line_keys, "args": dict(prod_args)}}


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(v, unit="", digits=3):
    if v is None:
        return "n/a"
    return f"{v:.{digits}g}{unit}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}{unit}"


def spread(values, unit="", digits=3):
    return "[" + ", ".join(fmt(v, unit, digits) for v in values) + "]"


# --- one boot --------------------------------------------------------------------------------

def run_boot(label, index, spec, model, scale, trace, run_dir, seed, say, calibrate=False, profile=True):
    from adapter.cpu.server import BootError, CpuServer
    from adapter.tools import canary

    boot_dir = run_dir / f"{index}-{label}"
    # the scale's pools and chunk first, then the line's: a line that changes one of them (half:
    # the chunk, swapool: the SWA ratio) must win
    args = at.server_args(model, scale, boot_dir)
    args.update(spec["args"])
    sc = at.scale_of(model, scale)
    session_tokens = (sc.session_system + sc.session_first
                      + sc.session_turns * (sc.turn_output + sc.session_user))
    server = CpuServer(model, keys=spec["keys"], args=args, name=f"{index}-{label}",
                       log_dir=boot_dir / "server", admin_calls=True,   # the workload flushes
                       extra_env=sc.server_env())
    out = {"label": label, "index": index, "keys": spec["keys"], "args": args, "env": sc.server_env(), "errors": []}
    began = time.monotonic()
    try:
        say(f"boot {index} ({label}): starting")
        server.start()
        out["boot_s"] = round(server.boot_s, 1)
        say(f"boot {index} ({label}): up in {server.boot_s:.0f}s")
        out["rows"] = at.run_agent_traffic(
            server, model=model, scale=scale, workdir=boot_dir, seed=seed, trace=trace,
            progress=lambda m: say(f"boot {index} ({label}): {m}"),
            profile_tokens=session_tokens if profile else None)
        if calibrate:
            out["calibration"] = at.calibrate_yield(server, boot_dir, model, seed,
                                                    progress=lambda m: say(f"boot {index} ({label}): {m}"))
    except BootError as exc:
        out["errors"].append(f"boot failed: {exc.summary()}")
    except Exception as exc:  # noqa: BLE001 - reported, the run goes on to the next boot
        out["errors"].append(f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
        logs = server.process_logs()
        out["log_dir"] = str(server.log_dir)
        out["errors"] += canary._log_errors(logs)
        out["pool"] = at.pool_sizes(logs)
        out["receipts"] = {a: at.dsv41_lines(logs, a) for a in ("swa_thin", "decode_yield", "swa_cone")}
        # a request's log line is written when it finishes, before its client run returns: the
        # conversations' turns are the requests that finished during the agent..resume runs
        phases = (out.get("rows") or {}).get("phases", {})
        if {"agent", "resume", "short", "streams"} <= set(phases):
            out["outputs_conversations"] = at.request_outputs(logs, phases["agent"][0], phases["resume"][1])
            out["outputs_all"] = at.request_outputs(logs, phases["short"][0], phases["streams"][1])
        else:
            out["outputs_conversations"] = out["outputs_all"] = {}
        out["wall_s"] = round(time.monotonic() - began, 1)
        say(f"boot {index} ({label}): stopped ({out['wall_s']:.0f}s)")
    return out


# --- rows and goals --------------------------------------------------------------------------

def aggregate(boots):
    ok = [b for b in boots if "rows" in b and not b["errors"]]
    by = {lab: [b for b in ok if b["label"] == lab] for lab in ("stock", "line")}
    res = {"boots_used": {lab: [b["index"] for b in v] for lab, v in by.items()}}
    if not by["stock"] or not by["line"]:
        res["incomplete"] = True
        return res
    # resumed turns whose window stock lost: on every stock boot, less than LOST of the prompt cached
    n_sessions = len(by["stock"][0]["rows"]["resume"]["resumed"])
    lost = [s for s in range(n_sessions)
            if all(b["rows"]["resume"]["resumed"][s]["cached_fraction"] < LOST for b in by["stock"])]
    res["resume_sessions"] = n_sessions
    res["resume_lost"] = lost
    for lab, bs in by.items():
        turns = [[b["rows"]["resume"]["resumed"][s] for s in lost] for b in bs]
        pooled = [t for ts in turns for t in ts]
        res[f"resume_{lab}"] = {
            "ttft_p50_s": at.pct([t["ttft_s"] for t in pooled], 50),
            "ttft_p99_s": at.pct([t["ttft_s"] for t in pooled], 99),
            "ttft_p50_per_boot": [at.pct([t["ttft_s"] for t in ts], 50) for ts in turns],
            "ttft_p99_per_boot": [at.pct([t["ttft_s"] for t in ts], 99) for ts in turns],
            "cached_fraction": (sum(t["cached_tokens"] for t in pooled) / max(1, sum(t["prompt_tokens"] for t in pooled))),
            "cached_fraction_per_boot": [sum(t["cached_tokens"] for t in ts) / max(1, sum(t["prompt_tokens"] for t in ts))
                                         for ts in turns],
            "prompt_tokens": [t["prompt_tokens"] for t in pooled],
            "all_resumed_cached_fraction": [b["rows"]["resume"]["cached_fraction"] for b in bs]}
        st = [b["rows"]["streams"] for b in bs]
        gaps = [g for s in st for g in s["itl_gaps_s"]]
        res[f"streams_{lab}"] = {
            "itl_p50_s": at.pct(gaps, 50), "itl_p99_s": at.pct(gaps, 99), "gaps": len(gaps),
            "itl_p50_per_boot": [s["itl_p50_s"] for s in st], "itl_p99_per_boot": [s["itl_p99_s"] for s in st],
            "itl_max_per_boot": [s["itl_max_s"] for s in st],
            "rate_ratio": med([s["rate_ratio"] for s in st]), "rate_ratio_per_boot": [s["rate_ratio"] for s in st],
            "long_ttft_s": med([s["long_ttft_s"] for s in st]), "long_ttft_per_boot": [s["long_ttft_s"] for s in st],
            "long_prompt_tokens": st[0]["long_prompt_tokens"],
            "streams_ended_early": sum(s["streams_ended_before_first_token"] for s in st)}
        sh = [b["rows"]["short"] for b in bs]
        res[f"short_{lab}"] = {k: med([s[k] for s in sh]) for k in ("request_throughput", "output_throughput", "ttft_p50_s")}
        res[f"short_{lab}"].update({f"{k}_per_boot": [s[k] for s in sh]
                                    for k in ("request_throughput", "output_throughput", "ttft_p50_s")})
        for role in ("scheduler", "launcher"):
            per = [(s.get("cpu_ms_per_request") or {}).get(role) for s in sh]
            res[f"short_{lab}"][f"{role}_cpu_ms_per_request"] = med(per)
            res[f"short_{lab}"][f"{role}_cpu_ms_per_request_per_boot"] = per
        res[f"profile_{lab}"] = [b["rows"].get("profile") for b in bs]
        res[f"pool_{lab}"] = [b["pool"] for b in bs]
        res[f"receipts_{lab}"] = {a: sorted({ln for b in bs for ln in b["receipts"][a]})[:6]
                                  for a in ("swa_thin", "decode_yield", "swa_cone")}
    # T=0 outputs: every boot against the first stock boot, prompt by prompt (ids from the
    # engine's request log), the conversations' turns (agent + resume runs) and every request
    ref = by["stock"][0]
    res["outputs"] = {f"{b['index']}-{b['label']}": {
        "conversation_turns": at.compare_outputs(ref["outputs_conversations"], b["outputs_conversations"]),
        "all_requests": at.compare_outputs(ref["outputs_all"], b["outputs_all"])}
        for b in ok if b is not ref}
    res["texts"] = {}
    ref_texts = [t["text"] for t in ref["rows"]["agent"]["turns"]] + \
                [t["text"] for t in ref["rows"]["resume"]["resumed"] + ref["rows"]["resume"]["later"]]
    for b in ok:
        if b is ref:
            continue
        texts = [t["text"] for t in b["rows"]["agent"]["turns"]] + \
                [t["text"] for t in b["rows"]["resume"]["resumed"] + b["rows"]["resume"]["later"]]
        res["texts"][f"{b['index']}-{b['label']}"] = {"equal": sum(x == y for x, y in zip(ref_texts, texts)),
                                                       "total": max(len(ref_texts), len(texts))}
    return res


def table(res):
    """The printed rows: (name, text)."""
    rows = []
    rs, rl = res["resume_stock"], res["resume_line"]
    n_lost = len(res["resume_lost"])
    lost = f"{n_lost} of {res['resume_sessions']} sessions x {len(res['boots_used']['line'])} boots"
    for q in ("p50", "p99"):
        s, l_ = rs[f"ttft_{q}_s"], rl[f"ttft_{q}_s"]
        rows.append((f"resume_ttft_{q}",
                     f"resumed-turn TTFT {q} (windows stock lost: {lost}) stock {fmt(s, ' s')} "
                     f"{spread(rs[f'ttft_{q}_per_boot'], ' s')} -> line {fmt(l_, ' s')} "
                     f"{spread(rl[f'ttft_{q}_per_boot'], ' s')} (x{fmt(ratio(s, l_))}; cluster {at.CLUSTER['resume_ttft']})"))
    rows.append(("resume_cached",
                 f"resumed-turn cached fraction (server cached_tokens / prompt tokens) stock "
                 f"{fmt(rs['cached_fraction'])} {spread(rs['cached_fraction_per_boot'])} -> line "
                 f"{fmt(rl['cached_fraction'])} {spread(rl['cached_fraction_per_boot'])} "
                 f"(cluster {at.CLUSTER['resume_cached']})"))
    ss, sl = res["streams_stock"], res["streams_line"]
    for q in ("p50", "p99"):
        rows.append((f"stream_itl_{q}",
                     f"stream ITL {q} while a {ss['long_prompt_tokens']}-token prompt prefills stock "
                     f"{fmt(ss[f'itl_{q}_s'], ' s')} {spread(ss[f'itl_{q}_per_boot'], ' s')} -> line "
                     f"{fmt(sl[f'itl_{q}_s'], ' s')} {spread(sl[f'itl_{q}_per_boot'], ' s')} "
                     f"(x{fmt(ratio(ss[f'itl_{q}_s'], sl[f'itl_{q}_s']))}; cluster {at.CLUSTER['stream_itl']})"))
    rows.append(("stream_rate",
                 f"stream rate during that prefill / before stock {fmt(ss['rate_ratio'])} "
                 f"{spread(ss['rate_ratio_per_boot'])} -> line {fmt(sl['rate_ratio'])} "
                 f"{spread(sl['rate_ratio_per_boot'])} (cluster {at.CLUSTER['stream_rate']})"))
    rows.append(("long_ttft",
                 f"long prompt TTFT stock {fmt(ss['long_ttft_s'], ' s')} {spread(ss['long_ttft_per_boot'], ' s')} "
                 f"-> line {fmt(sl['long_ttft_s'], ' s')} {spread(sl['long_ttft_per_boot'], ' s')} "
                 f"(x{fmt(ratio(sl['long_ttft_s'], ss['long_ttft_s']))} later; cluster {at.CLUSTER['long_ttft']})"))
    ks, kl = res["short_stock"], res["short_line"]
    for key, name, unit in (("request_throughput", "requests/s", ""), ("output_throughput", "output tokens/s", ""),
                            ("ttft_p50_s", "TTFT p50", " s")):
        rows.append((f"short_{key}",
                     f"short traffic {name} stock {fmt(ks[key], unit)} {spread(ks[key + '_per_boot'], unit)} -> line "
                     f"{fmt(kl[key], unit)} {spread(kl[key + '_per_boot'], unit)} (line/stock "
                     f"{fmt(ratio(kl[key], ks[key]), digits=4)}; cluster {at.CLUSTER['short']})"))
    for role in ("scheduler", "launcher"):
        key = f"{role}_cpu_ms_per_request"
        rows.append((f"short_{key}",
                     f"short traffic {role} CPU per request (user+sys, the server's own process) stock "
                     f"{fmt(ks[key], ' ms')} {spread(ks[key + '_per_boot'], ' ms')} -> line {fmt(kl[key], ' ms')} "
                     f"{spread(kl[key + '_per_boot'], ' ms')} (line/stock {fmt(ratio(kl[key], ks[key]), digits=4)})"))
    rows.append(("outputs",
                 "T=0 output ids of the conversations' turns, line boots vs stock boot 1: "
                 + ", ".join(f"{k} {v['conversation_turns']['equal']} of {v['conversation_turns']['total']}"
                             for k, v in res["outputs"].items())
                 + " (all requests: " + ", ".join(f"{k} {v['all_requests']['equal']} of {v['all_requests']['total']}"
                                                   for k, v in res["outputs"].items())
                 + f"; cluster {at.CLUSTER['outputs']})"))
    return rows


def pair_ratios(num, den):
    """Ratios of the alternating boot pairs (stock boot i with line boot i)."""
    return [ratio(a, b) for a, b in zip(num, den)]


def same_line_spread(values):
    values = [v for v in values if v]
    return (max(values) / min(values) - 1) if len(values) > 1 else 0.0


def goals(res):
    """One verdict per goal. A timing goal is met when the ratio of the pooled figures meets it
    and so does every alternating boot pair's ratio (a pair that disagrees is machine noise
    larger than the goal's margin, and the goal is not shown); the text gives both, and how far
    the boots of one line are apart."""
    out = []

    def goal(name, met, text):
        out.append({"goal": name, "met": bool(met), "text": f"goal {name}: {'met' if met else 'missed'}: {text}"})

    def timing(name, pooled, pairs, ok, need, what, stock_boots, line_boots):
        good = pooled is not None and ok(pooled) and all(p is not None and ok(p) for p in pairs)
        goal(name, good, f"{what} = x{fmt(pooled, digits=4)} (alternating boot pairs {spread(pairs, digits=4)}; "
                         f"need {need}; boots of one line apart by stock {same_line_spread(stock_boots):.0%}, "
                         f"line {same_line_spread(line_boots):.0%})")

    rs, rl = res["resume_stock"], res["resume_line"]
    timing("resume-ttft", ratio(rs["ttft_p50_s"], rl["ttft_p50_s"]),
           pair_ratios(rs["ttft_p50_per_boot"], rl["ttft_p50_per_boot"]), lambda r: r >= GOAL_RESUME_TTFT,
           f">= x{GOAL_RESUME_TTFT:g} lower",
           f"resumed turns whose window stock lost ({len(res['resume_lost'])} of {res['resume_sessions']} sessions "
           f"per boot): TTFT p50 stock {fmt(rs['ttft_p50_s'], ' s')} / line {fmt(rl['ttft_p50_s'], ' s')}",
           rs["ttft_p50_per_boot"], rl["ttft_p50_per_boot"])
    goal("resume-cached", bool(res["resume_lost"]) and rl["cached_fraction"] >= GOAL_RESUME_CACHED
         and all(f >= GOAL_RESUME_CACHED for f in rl["cached_fraction_per_boot"]),
         f"cached fraction of those turns on the line {fmt(rl['cached_fraction'])} {spread(rl['cached_fraction_per_boot'])} "
         f"(need >= {GOAL_RESUME_CACHED}); stock's on the same turns {fmt(rs['cached_fraction'])} "
         f"{spread(rs['cached_fraction_per_boot'])}")
    ss, sl = res["streams_stock"], res["streams_line"]
    timing("stream-itl", ratio(ss["itl_p99_s"], sl["itl_p99_s"]),
           pair_ratios(ss["itl_p99_per_boot"], sl["itl_p99_per_boot"]), lambda r: r >= GOAL_ITL_P99,
           f">= x{GOAL_ITL_P99:g} lower",
           f"streams beside a long prefill, DSV41_DECODE_YIELD=33 with the fitted model: ITL p99 stock "
           f"{fmt(ss['itl_p99_s'], ' s')} / line {fmt(sl['itl_p99_s'], ' s')}",
           ss["itl_p99_per_boot"], sl["itl_p99_per_boot"])
    timing("long-ttft", ratio(sl["long_ttft_s"], ss["long_ttft_s"]),
           pair_ratios(sl["long_ttft_per_boot"], ss["long_ttft_per_boot"]), lambda r: r <= GOAL_LONG_TTFT,
           f"<= x{GOAL_LONG_TTFT:g}",
           f"the long prompt's TTFT line {fmt(sl['long_ttft_s'], ' s')} / stock {fmt(ss['long_ttft_s'], ' s')}",
           ss["long_ttft_per_boot"], sl["long_ttft_per_boot"])
    ks, kl = res["short_stock"], res["short_line"]
    for key, name in (("request_throughput", "requests/s"), ("output_throughput", "output tokens/s")):
        timing(f"short-throughput ({name})", ratio(kl[key], ks[key]),
               pair_ratios(kl[key + "_per_boot"], ks[key + "_per_boot"]), lambda r: r >= GOAL_THROUGHPUT,
               f">= {GOAL_THROUGHPUT}", f"short traffic {name} line {fmt(kl[key])} / stock {fmt(ks[key])}",
               ks[key + "_per_boot"], kl[key + "_per_boot"])
    timing("short-ttft", ratio(kl["ttft_p50_s"], ks["ttft_p50_s"]),
           pair_ratios(kl["ttft_p50_s_per_boot"], ks["ttft_p50_s_per_boot"]), lambda r: r <= GOAL_SHORT_TTFT,
           f"<= {GOAL_SHORT_TTFT}", f"short traffic TTFT p50 line {fmt(kl['ttft_p50_s'], ' s')} / stock "
                                    f"{fmt(ks['ttft_p50_s'], ' s')}",
           ks["ttft_p50_s_per_boot"], kl["ttft_p50_s_per_boot"])
    conv = [v["conversation_turns"] for k, v in res["outputs"].items() if k.endswith("line")]
    eq, tot = sum(c["equal"] for c in conv), sum(c["total"] for c in conv)
    goal("outputs", tot > 0 and eq == tot,
         f"T=0 turns of the same conversations: {eq} of {tot} prompts gave the same output ids on the line "
         f"boots as on stock boot 1 (engine request log); stock boot vs stock boot: "
         + (", ".join(f"{k} {v['conversation_turns']['equal']} of {v['conversation_turns']['total']}"
                      for k, v in res["outputs"].items() if k.endswith("stock")) or "n/a (one stock boot)"))
    return out


def profile_lines(res, goal_list, fit):
    """Where the time went, for each missed goal: measured on the same boots."""
    missed = {g["goal"] for g in goal_list if not g["met"]}
    out = []
    if missed & {"resume-ttft", "resume-cached"}:
        for lab in ("stock", "line"):
            for p in res[f"profile_{lab}"]:
                if p:
                    out.append(f"profile resume ({lab} boot): alone on the server, a cold {p['tokens']}-token prompt "
                               f"{p['cold_prefill_s']:.3f} s (chunks of the line's --chunked-prefill-size) vs the same "
                               f"prompt cached + 64 new tokens {p['hit_plus_64_s']:.3f} s ({p['hit_cached_tokens']} cached): "
                               f"x{fmt(p['cold_over_hit'])}")
        out.append(f"profile resume: pools {res['pool_stock'][0]} (stock) / {res['pool_line'][0]} (line); prompt "
                   f"tokens of the resumed turns {sorted(set(res['resume_line']['prompt_tokens']))}")
    if missed & {"stream-itl", "long-ttft"}:
        for lab in ("stock", "line"):
            s = res[f"streams_{lab}"]
            out.append(f"profile streams ({lab}): longest gap per boot {spread(s['itl_max_per_boot'], ' s')}, "
                       f"p50 {spread(s['itl_p50_per_boot'], ' s')}, {s['gaps']} gaps in the windows")
        out += [f"profile streams (line): {ln}" for ln in res["receipts_line"]["decode_yield"] if "left chunked" in ln][:4]
        if fit:
            out.append(f"profile streams: fitted model {fit['value']}: {fit['plans_for']}: share 33 plans "
                       f"{fit['plans'][33]} decode steps")
    if any(g.startswith("short-") for g in missed):
        for key in ("request_throughput", "ttft_p50_s", "scheduler_cpu_ms_per_request", "launcher_cpu_ms_per_request"):
            out.append(f"profile short: {key} per boot stock {spread(res['short_stock'][key + '_per_boot'])} "
                       f"line {spread(res['short_line'][key + '_per_boot'])} (line/stock of the medians "
                       f"{fmt(ratio(res['short_line'][key], res['short_stock'][key]), digits=4)})")
    return out


# --- lines beside the engine's own knobs (--lines, issue 43) -----------------------------------------

# (key, column, unit, which way is better); values per boot from each boot's rows
KNOB_COLUMNS = (
    ("itl_p50_s", "stream ITL p50 in the long prefill", " s", "lower"),
    ("itl_p99_s", "stream ITL p99 in the long prefill", " s", "lower"),
    ("rate_ratio", "stream rate during / before", "", "higher"),
    ("long_ttft_s", "long prompt TTFT", " s", "lower"),
    ("short_rps", "short traffic requests/s", "", "higher"),
    ("resume_cached", "resumed-turn cached fraction", "", "higher"),
    ("resume_ttft_s", "resumed-turn TTFT p50", " s", "lower"),
)


def knob_values(boot) -> dict:
    rows = boot["rows"]
    st = rows["streams"]
    return {"itl_p50_s": st["itl_p50_s"], "itl_p99_s": st["itl_p99_s"], "rate_ratio": st["rate_ratio"],
            "long_ttft_s": st["long_ttft_s"], "short_rps": rows["short"]["request_throughput"],
            "resume_cached": rows["resume"]["cached_fraction"], "resume_ttft_s": rows["resume"]["ttft_p50_s"]}


def knob_aggregate(boots, names, page=1) -> dict:
    """Per line: each figure per boot, its median, how far the line's own boots are apart, the ratio
    of its median to stock's and of each boot round's value to that round's stock boot; the pools
    the engine logged per boot; full-pool tokens a resumed session holds (its resumed prompt, in
    pages) and the full pool's capacity in such sessions; T=0 output ids of the conversations'
    turns against stock boot 1."""
    ok = [b for b in boots if "rows" in b and not b["errors"]]
    by = {n: [b for b in ok if b["label"] == n] for n in names}
    stock = by.get("stock") or []
    ref = stock[0] if stock else None
    stock_values = [knob_values(b) for b in stock]
    # each boot against the stock boot of its own round (boots run round by round, the lines in
    # order), None where that round's stock boot failed

    def round_of(boot) -> int:
        return (boot["index"] - 1) // len(names)

    round_stock = {round_of(b): v for b, v in zip(stock, stock_values)}
    out = {}
    for name in names:
        bs = by[name]
        values = [knob_values(b) for b in bs]
        per = {k: [v[k] for v in values] for k, *_ in KNOB_COLUMNS}
        session = max((t["prompt_tokens"] for b in bs for t in b["rows"]["resume"]["resumed"]), default=0)
        held = at.session_full_tokens(session, page) if session else None
        pools = [b["pool"] for b in bs]
        row = {"boots": [b["index"] for b in bs], "per_boot": per,
               "median": {k: med(v) for k, v in per.items()},
               "apart": {k: same_line_spread(v) for k, v in per.items()},
               "pools": pools, "session_full_tokens": held,
               "capacity_sessions": [p["full"] // held if p and held else None for p in pools],
               "outputs_vs_stock_boot_1": [at.compare_outputs(ref["outputs_conversations"], b["outputs_conversations"])
                                           for b in bs if b is not ref] if ref else []}
        if stock:
            row["vs_stock"] = {k: ratio(row["median"][k], med([v[k] for v in stock_values])) for k in per}
            row["vs_stock_per_round"] = {
                k: [ratio(v[k], round_stock[round_of(b)][k]) if round_of(b) in round_stock else None
                    for b, v in zip(bs, values)]
                for k in per}
        out[name] = row
    return out


def knob_table(agg, spec) -> list[str]:
    """The --lines table, markdown: one row per line, per-boot values in brackets, x = median over
    stock's median (per boot round in the JSON)."""
    head = ["line", "change"] + [c for _, c, _, _ in KNOB_COLUMNS] + ["full / SWA pool (engine log, per boot)",
                                                                     "full KV per resumed session (pool capacity in sessions)",
                                                                     "T=0 turns vs stock boot 1"]
    lines_ = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in agg.items():
        cells = [name, spec[name]["change"]]
        for key, _, unit, _ in KNOB_COLUMNS:
            cell = f"{fmt(row['median'][key], unit)} {spread(row['per_boot'][key])}"
            if name != "stock" and row.get("vs_stock", {}).get(key) is not None:
                cell += f" x{fmt(row['vs_stock'][key])}"
            cells.append(cell)
        cells.append(", ".join(f"{p['full']:,} / {p['swa']:,}" + (f" ({p['mode']}{', tails ' + str(p['tails']) if 'tails' in p else ''}"
                                                                  f"{', ratio ' + str(p['ratio']) if 'ratio' in p else ''})" if "mode" in p else "")
                               if p else "n/a" for p in row["pools"]))
        cells.append(f"{row['session_full_tokens']:,} ({', '.join(f'{c:,}' if c is not None else 'n/a' for c in row['capacity_sessions'])})"
                     if row["session_full_tokens"] else "n/a")
        cells.append(", ".join(f"{o['equal']} of {o['total']}" for o in row["outputs_vs_stock_boot_1"]) or "(reference)")
        lines_.append("| " + " | ".join(cells) + " |")
    return lines_


def machine():
    info = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    try:
        mem = pathlib.Path("/proc/meminfo").read_text().splitlines()[0]
        info["mem_total_kb"] = int(re.findall(r"\d+", mem)[0])
        info["loadavg"] = pathlib.Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["sglang"] = version("sglang")
        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001
        pass
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = sorted({m for m, s in at.SCALES if s == "bench"})
    ap.add_argument("--cpu-model", default="swa", choices=models)
    ap.add_argument("--scale", default="bench", choices=sorted({s for _, s in at.SCALES}))
    ap.add_argument("--boots", type=int, default=2, help="boots per line (alternating), >= 2")
    ap.add_argument("--seed", type=int, default=at.SEED)
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--yield-model", default=None,
                    help="DSV41_DECODE_YIELD_MODEL for the line (default: fitted on the first stock boot)")
    ap.add_argument("--out", default=None, help="run directory (default runs/agent_traffic/<time>)")
    ap.add_argument("--lines", nargs="+", default=list(DEFAULT_LINES), choices=list(at.KNOB_LINES), metavar="LINE",
                    help="lines to boot, alternating, --boots rounds of them (default: stock line); besides "
                         "the two: " + "; ".join(f"{k} = {v}" for k, v in at.KNOB_LINES.items() if k not in DEFAULT_LINES)
                         + ". Other lines than the default add the knobs table (issue 43); use a scale "
                           "whose pools the engine sizes (--cpu-model dsv4 --scale knobs) for the tails lines")
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(args.lines))
    began = time.monotonic()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = pathlib.Path(args.out or REPO_ROOT / "runs" / "agent_traffic" / stamp)
    run_dir.mkdir(parents=True, exist_ok=True)

    def say(msg):
        print(f"[agent-traffic {time.monotonic() - began:5.0f}s] {msg}", file=sys.stderr, flush=True)

    base = lines(args.profile, args.yield_model, args.cpu_model)
    chunk = at.server_args(args.cpu_model, args.scale, run_dir)["--chunked-prefill-size"]
    spec = at.knob_lines(names, base["stock"], base["line"], chunk)
    knobs = names != list(DEFAULT_LINES)
    say(f"trace: {args.cpu_model} / {args.scale}, seed {args.seed} -> {run_dir / 'trace'}; lines {' '.join(names)}")
    trace = at.write_trace(run_dir / "trace", args.cpu_model, args.scale, args.seed)
    at.client_module()          # the client's imports once, before the first boot
    fit = None
    boots = []
    order = [lab for _ in range(args.boots) for lab in names]
    # a line whose decode yield scales its cost model from the engine's own step timings
    # (DSV41_DECODE_YIELD_ONLINE=1) runs as the profile has it: no fitted model is added
    online = spec.get("line", {}).get("keys", {}).get("DSV41_DECODE_YIELD_ONLINE") == "1"
    for i, lab in enumerate(order, 1):
        if lab == "line" and "DSV41_DECODE_YIELD_MODEL" not in spec["line"]["keys"] and not online:
            if fit is None:
                raise SystemExit("no fitted DSV41_DECODE_YIELD_MODEL (the first stock boot's calibration failed, "
                                 "or the line boots before stock): "
                                 f"see {boots[0].get('log_dir') if boots else 'the run'} or pass --yield-model")
            spec["line"]["keys"]["DSV41_DECODE_YIELD_MODEL"] = fit["value"]
        calibrate = lab == "stock" and fit is None and not args.yield_model and "line" in names and not online
        b = run_boot(lab, i, spec[lab], args.cpu_model, args.scale, trace, run_dir, args.seed, say, calibrate,
                     profile=not knobs)      # the profile rows explain the two lines' goals
        if calibrate and "calibration" in b:
            fit = b["calibration"]
        boots.append(b)
        # each boot's rows as they come: a run stopped early keeps what it measured
        (run_dir / "boots.partial.json").write_text(json.dumps(
            [{k: v for k, v in x.items() if not k.startswith("outputs_")} for x in boots], indent=1, default=str))
    res = aggregate(boots) if {"stock", "line"} <= set(names) else {"incomplete": True}
    report = {"command": " ".join([".venv/bin/python bench/agent_traffic.py",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine(),
              "model": args.cpu_model, "scale": args.scale, "seed": args.seed, "boots_per_line": args.boots,
              "scaling": at.scaling_table(args.cpu_model, args.scale), "cluster": at.CLUSTER,
              "lines": spec, "yield_fit": fit, "trace": trace.meta,
              "boots": [{k: v for k, v in b.items() if not k.startswith("outputs_")} for b in boots],
              "aggregate": res}
    errors = [f"boot {b['index']} ({b['label']}): {e}" for b in boots for e in b["errors"]]
    report["lines_run"] = names
    if knobs:
        from adapter.cpu.server import MODEL_DEFAULT_ARGS

        page = int(MODEL_DEFAULT_ARGS.get(args.cpu_model, {}).get("--page-size", 1))   # dsv4: 256
        report["knobs"] = knob_aggregate(boots, names, page)
        report["knobs_table"] = knob_table(report["knobs"], spec) if "stock" in names else []
        print(f"lines beside the engine's own knobs on the CPU '{args.cpu_model}' model, scale {args.scale} "
              f"({args.boots} boots per line, alternating {' '.join(names)}; seed {args.seed}); "
              f"medians [per boot], x = over stock's median")
        for ln in report["knobs_table"]:
            print(ln)
        for e in errors:
            print(f"error: {e}")
        if not {"stock", "line"} <= set(names):
            report["elapsed_s"] = round(time.monotonic() - began, 1)
            out = run_dir / "agent_traffic.json"
            out.write_text(json.dumps(report, indent=1, default=str))
            print(f"rows: {out} ({report['elapsed_s']:.0f} s)")
            return 1 if errors else 0
    if res.get("incomplete"):
        report["goals"] = []
        print("\n".join(["agent traffic: incomplete run"] + errors))
        code = 1
    else:
        rows = table(res)
        gl = goals(res)
        prof = profile_lines(res, gl, fit)
        report["rows"] = [{"row": n, "text": t} for n, t in rows]
        report["goals"] = gl
        report["profile"] = prof
        print(f"agent traffic on the CPU '{args.cpu_model}' model ({args.boots} boots per line, alternating; "
              f"seed {args.seed}); {'fitted' if fit else 'given'} DSV41_DECODE_YIELD_MODEL="
              f"{spec['line']['keys'].get('DSV41_DECODE_YIELD_MODEL')}")
        if args.cpu_model == "swa":
            print("  cone declines on this model (no DeepSeek-V4 backend): the resume rows show thin's effect")
        for _, text in rows:
            print(f"agent traffic: {text}")
        for e in errors:
            print(f"error: {e}")
        for ln in prof:
            print(ln)
        for g in gl:
            print(g["text"])
        code = 0 if all(g["met"] for g in gl) and not errors else 1
    report["elapsed_s"] = round(time.monotonic() - began, 1)
    out = run_dir / "agent_traffic.json"
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"rows: {out} ({report['elapsed_s']:.0f} s)")
    return code


if __name__ == "__main__":
    sys.exit(main())
