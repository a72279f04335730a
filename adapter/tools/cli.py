"""The `dsv41` command: check, canary, gate, calibrate, pins, keys, sim, profile.

Every command that takes a profile line names it the same way: `--profile FILE --line NAME`, and
`--against NAME` for the line it is compared with. Exit codes: one table for all commands
(adapter/tools/exits.py; README "Exit codes").
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from adapter.tools import exits
# The line and --cpu-model helpers every command shares (a leaf module: the gate and the canary
# import it, not this one); named here too for callers of cli.
from adapter.tools.lines import CPU_MODELS, add_cpu_model_arg, add_line_args, cpu_models  # noqa: F401

SIMS = {  # `dsv41 sim NAME` -> module with main(argv) -> int
    "yield": "adapter.tools.sims.decode_yield",
    "thin": "adapter.tools.sims.swa_thin",
    "cone": "adapter.tools.sims.swa_cone",
    "autotune": "adapter.tools.sims.autotune_keep",
    "all": "adapter.tools.sims.all",
}


def cmd_check(args) -> int:
    from adapter import keys
    from adapter.tools import check, profile

    try:
        line = profile.load_line(args.profile, args.line)
        profile.refuse_test_only(line)         # a test-only key on a line that is not a test line
    except (OSError, profile.ProfileError, keys.ConfigError) as exc:
        print(f"dsv41 check: {exc}", file=sys.stderr)
        return exits.USAGE
    progress = not args.json
    if progress:          # one line while the child boots (it imports the engine: ~10-15 s)
        print(f"dsv41 check: starting a child Python as a production process of line {args.line!r} "
              f"(it imports the engine, ~12 s) ...", end="", file=sys.stderr, flush=True)
    began = time.monotonic()
    code, rows, stderr = check.run(line)
    if progress:
        print(f" done in {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    receipts = check.receipt_lines(stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        acting, judged = check.act_on_cluster(rows)
        print(f"profile {args.profile} line {args.line}: "
              f"{sum(r['installed'] for r in rows)} of {sum(r['enabled'] for r in rows)} enabled adapters installed"
              + (f"; {acting} of {judged} act on the cluster (DeepSeek-V4.1, CUDA)" if judged else ""))
        print(check.format_table(rows, receipts))
        if receipts:
            print("\nreceipt lines from the child (each once):\n" + "\n".join(receipts))
    if code != 0:
        print(f"dsv41 check: child exited {code}:\n{stderr[-4000:]}", file=sys.stderr)
    return check.exit_code(code, rows)


def cmd_pins(args) -> int:
    """Wrapped callables (source sha256) and touched internals per adapter, against pins.json."""
    from adapter import pins
    from adapter.cpu import cpu_engine
    from adapter.table import ADAPTERS, INFRA_TOUCHES, hooks_of

    cpu_engine.install_torchvision_shim()
    if args.update:
        try:
            new = pins.update()
        except LookupError as exc:
            print(f"dsv41 pins: {exc}", file=sys.stderr)
            return exits.USAGE
        touched = len(pins.load_touches())
        print(f"wrote {pins.PINS_FILE.name}: {len(new)} pins and {touched} touched internals "
              f"for {pins.ENGINE}")
        return 0
    pinned, pinned_touches = pins.load(), pins.load_touches()
    report = []
    for name in (*ADAPTERS, *INFRA_TOUCHES):
        wraps = [{"id": r.pin_id, "pinned": pinned.get(r.pin_id),
                  "found": pins.source_hash(pins.resolve(r)[2])} for r in hooks_of(name)]
        touches = [{"id": t, "pinned": pinned_touches.get(t), "found": pins.fingerprint(t)}
                   for t in pins.touches_of(name)]
        for item in wraps + touches:
            item["ok"] = item["pinned"] == item["found"]
        report.append({"adapter": name, "wraps": wraps, "touches": touches})
    bad = sum(not i["ok"] for r in report for i in r["wraps"] + r["touches"])
    if args.json:
        print(json.dumps({"engine": pins.ENGINE, "ok": bad == 0, "drift": bad, "adapters": report},
                         indent=2))
    else:
        for r in report:
            print(r["adapter"])
            for kind in ("wraps", "touches"):
                for i in r[kind]:
                    print(f"  {'ok' if i['ok'] else 'DRIFT':5s} {kind:7s} {i['id']} {str(i['found'])[:16]}")
        print(f"{'all pins ok' if not bad else f'{bad} pins drifted'} ({pins.ENGINE})")
    return exits.FAILED if bad else exits.OK


def cmd_keys(args) -> int:
    from adapter import keys

    if args.volatile:
        names = keys.volatile_keys()
        print(json.dumps(list(names)) if args.json else "\n".join(names))
        return 0
    rows = [{"key": k.name, "adapter": k.adapter, "kind": k.kind, "default": k.default,
             "range": [k.lo, k.hi], "fields": [list(f) for f in k.fields], "volatile": k.volatile,
             "test_only": k.test_only, "enables": k.enables, "multiple_of": k.multiple_of,
             "range_text": key_range(k), "doc": k.doc}
            for k in keys.KEYS]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(format_keys(keys.KEYS))
    return 0


def key_range(k) -> str:
    """A key's accepted values, as `dsv41 keys` prints them."""
    if k.kind == "flag":
        return "0/1"
    if k.kind == "ints":
        least = k.min_fields or len(k.fields)
        count = f"{least}" if least == len(k.fields) else f"{least}-{len(k.fields)}"
        return f"{count} ints"
    if k.lo is None and k.hi is None:
        return "int"
    text = f"{'' if k.lo is None else k.lo}..{'' if k.hi is None else k.hi}"
    return text + (f" step {k.multiple_of}" if k.multiple_of else "")


def format_keys(registry) -> str:
    """One aligned row per key (widths from the longest cell, so long names keep the columns),
    its description wrapped under it."""
    import textwrap

    head = ("key", "adapter", "type", "range", "default", "volatility", "role")
    body = [(k.name, k.adapter, k.kind, key_range(k), "unset" if k.default is None else str(k.default),
             "volatile" if k.volatile else "launch",
             "test-only" if k.test_only else ("on switch" if k.enables else "setting"))
            for k in registry]
    widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(head, widths)).rstrip()]
    for k, cells in zip(registry, body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        lines.extend(textwrap.wrap(k.doc, width=100, initial_indent="    ", subsequent_indent="    "))
    lines.extend(textwrap.wrap(
        "volatile: left out of autotune_keep's launch fingerprint (toggling it keeps the tuned "
        "tactics; launch arguments never are). on switch: setting it turns its adapter on; "
        "test-only: on a test line only. Keys are read when a process starts.", width=100))
    return "\n".join(lines)


def cmd_sim(args, rest) -> int:
    if args.name in (None, "-h", "--help"):
        args.sim_parser.print_help()
        print("\n`dsv41 sim NAME --help` shows a simulation's own options.")
        return exits.OK if args.name else exits.USAGE
    if args.name not in SIMS:
        args.sim_parser.print_usage(sys.stderr)
        print(f"dsv41 sim: unknown simulation {args.name!r} (choose from {', '.join(sorted(SIMS))})",
              file=sys.stderr)
        return exits.USAGE
    return importlib.import_module(SIMS[args.name]).main(rest)


def cmd_profile(args) -> int:
    from adapter.tools import profile_diff

    return profile_diff.main(args)


def cmd_canary(args) -> int:
    from adapter.tools import canary

    return canary.main(args)


def cmd_calibrate(args) -> int:
    from adapter.tools import calibrate

    return calibrate.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="install a profile line into the pinned engine and report")
    add_line_args(c)
    c.add_argument("--json", action="store_true", help="print the rows as JSON")
    c.set_defaults(func=cmd_check)
    cn = sub.add_parser("canary", help="boot a profile line and its control in a real CPU server; "
                                       "same traffic through both; per-adapter report")
    add_line_args(cn, against="control", what="the line under test")
    cn.add_argument("--cpu-model", dest="model", type=cpu_models, default="dense,dsv41",
                    metavar="MODELS",
                    help="tiny CPU models, a comma list of " + ", ".join(
                        f"{m} ({kind})" for m, kind in CPU_MODELS.items())
                    + "; all = every one; both = dense,swa; the tiny DeepSeek-V4.1 is the model the "
                    "cluster serves (default %(default)s)")
    cn.add_argument("--nodes", type=int, default=1, metavar="N",
                    help="boot both lines as the cluster's topology on this machine: --tp-size N "
                         "over N launch processes (--nnodes N on 127.0.0.1) (default 1)")
    cn.add_argument("--traffic", choices=["canary", "agent"], default="canary",
                    help="canary (default): the canary's own scenarios; agent: those, then an "
                         "agent workload replayed by the engine's own benchmark client "
                         "(sglang.bench_serving: multi-turn sessions, sub-agents, other users' long "
                         "prompts, resumed turns, streams beside a long prefill; smaller than "
                         "bench/agent_traffic.py) on both boots of each model that has a sliding "
                         "window (swa, dsv4); adds its rows to the table (docs/performance.md)")
    cn.add_argument("--json", action="store_true", help="print the report as JSON")
    cn.set_defaults(func=cmd_canary)
    cal = sub.add_parser("calibrate", help="fit decode yield's cost model to an engine's own "
                                           "scheduler log; prints the DSV41_DECODE_YIELD_MODEL value")
    cal.add_argument("what", choices=["yield"], help="what to calibrate (decode yield's cost model)")
    cal.add_argument("--log", action="append", required=True, help="scheduler log (repeatable)")
    from adapter.tools.calibrate import DEFAULT_DECODE_LOG_INTERVAL   # light: stdlib imports only

    cal.add_argument("--decode-log-interval", type=int, default=None,
                     help="the engine's --decode-log-interval when the log has no iters (default "
                          f"{DEFAULT_DECODE_LOG_INTERVAL})")
    cal.add_argument("--json", action="store_true", help="print the fit as JSON")
    cal.add_argument("--plot", default=None, help="PNG of the fit")
    cal.set_defaults(func=cmd_calibrate)
    pn = sub.add_parser("pins", help="check (or --update) the pins: wrapped callables and the "
                                     "engine internals each adapter touches")
    pn.add_argument("--update", action="store_true", help="regenerate adapter/pins.json")
    pn.add_argument("--json", action="store_true", help="print the report as JSON")
    pn.set_defaults(func=cmd_pins)
    k = sub.add_parser("keys", help="list the DSV41_* keys: type, range, default, volatility")
    k.add_argument("--volatile", action="store_true",
                   help="only the keys autotune_keep leaves out of the launch fingerprint")
    k.add_argument("--json", action="store_true", help="print the keys as JSON")
    k.set_defaults(func=cmd_keys)
    s = sub.add_parser("sim", help="simulations on the real engine classes "
                                   f"({', '.join(sorted(SIMS))}); `dsv41 sim NAME --help`",
                       add_help=False)
    s.add_argument("name", nargs="?", metavar="NAME",
                   help=f"simulation: {', '.join(sorted(SIMS))}; its own options follow")
    s.set_defaults(func=cmd_sim, takes_rest=True, sim_parser=s)
    pr = sub.add_parser("profile", help="compare two profile lines: what differs, what is "
                                        "volatile, whether it re-tunes, one rollback per adapter")
    pr.add_argument("action", choices=["diff"], help="diff: changes from --against to --line")
    add_line_args(pr, against="control", what="the line after the change")
    pr.add_argument("--against-profile", default=None, metavar="FILE",
                    help="profile file of the --against line (default: --profile)")
    pr.add_argument("--json", action="store_true", help="print the diff as JSON")
    pr.set_defaults(func=cmd_profile)
    from adapter.tools.gate.cli import add_parser as add_gate_parser  # `dsv41 gate run|verdict|boot`

    add_gate_parser(sub)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"] and len(argv) > 1 and argv[1] not in ("-h", "--help"):
        # `dsv41 sim NAME ...`: everything after NAME belongs to the simulation's own parser
        args, rest = build_parser().parse_args(argv[:2]), argv[2:]
    else:
        args, rest = build_parser().parse_known_args(argv)
    if getattr(args, "takes_rest", False):
        if args.name is None and rest[:1] and rest[0] in ("-h", "--help"):
            args.name = rest[0]
        return args.func(args, rest)
    if rest:
        build_parser().error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
