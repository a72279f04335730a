"""The `dsv41 gate` argparse block (adapter/tools/cli.py adds it): run, verdict, boot."""
from __future__ import annotations

import argparse


def _run(args) -> int:
    from adapter.tools.gate import run

    return run.main(args)


def _verdict(args) -> int:
    from adapter.tools.gate import verdict

    return verdict.main(args)


def _boot(args) -> int:
    from adapter.tools.gate import boot

    return boot.main(args)


def _thresholds(p: argparse.ArgumentParser, defaults: dict, where: str = "") -> None:
    """The verdict's thresholds. Each flag's value stays None on the command line (the verdict
    fills in its own), so the help states the default the code applies: `defaults` is that dict
    (gate/verdict.py DEFAULTS, or gate boot's CPU values over it)."""
    p.add_argument("--speed-floor", type=float, default=None,
                   help=f"relative speed noise assumed at least (default {defaults['speed_floor']:g}"
                        f"{where})")
    p.add_argument("--kld-long", type=float, default=None,
                   help=f"KL reference of the long prompt (default {defaults['kld_long']:g}, the "
                        "cluster's accepted run)")
    p.add_argument("--kld-short", type=float, default=None,
                   help=f"KL reference of the short prompts (default {defaults['kld_short']:g})")
    p.add_argument("--t1-alpha", type=float, default=None,
                   help=f"family-wise level of the T=1 tests (default {defaults['t1_alpha']:g}, "
                        "Bonferroni over prompts)")
    p.add_argument("--max-excluded", type=int, default=None,
                   help="T=0 prompts on which the controls may differ (default 10%% of them, at least 1)")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")


def threshold_defaults(command: str) -> dict:
    """The thresholds `gate verdict` / `gate boot` apply when a flag is not given."""
    from adapter.tools.gate import boot, verdict

    if command == "boot":
        return dict(verdict.DEFAULTS, speed_floor=boot.CPU_SPEED_FLOOR, t1_alpha=boot.CPU_T1_ALPHA)
    return dict(verdict.DEFAULTS)


def add_parser(sub) -> None:
    from adapter.tools.gate.cells import SUITES

    g = sub.add_parser("gate", help="the A/B/A release gate against OpenAI-compatible servers (docs/gate.md)")
    gs = g.add_subparsers(dest="gate_command", required=True)
    r = gs.add_parser("run", help="measure one boot: every cell into <out>/<run-id>/<label>/ (resumable)")
    r.add_argument("--endpoint", required=True, help="server URL, e.g. http://head:30000 (or .../v1)")
    r.add_argument("--label", required=True, help="this boot's label, e.g. A, B, A2")
    r.add_argument("--out", required=True, help="runs directory, e.g. runs/")
    r.add_argument("--suite", choices=sorted(SUITES), default="quick",
                   help="quick (CPU harness, minutes) or full (the cluster's release gate) (default %(default)s)")
    r.add_argument("--model", default=None, help="served model name (default: the first /v1/models lists)")
    r.add_argument("--run-id", default=None, help="run id (default: today's UTC date, YYYYMMDD)")
    r.add_argument("--context-length", type=int, default=None,
                   help="when the server reports none in /v1/models")
    r.add_argument("--server-pid", type=int, default=None,
                   help="a process of the server's process group on this machine: the speed cells also "
                        "record tokens per server CPU-second, which the verdict judges when every boot has them")
    r.add_argument("--json", action="store_true", help="print what was measured as JSON")
    r.set_defaults(func=_run)
    v = gs.add_parser("verdict", help="PASS / KILL / INVALID of control,candidate,control; report.md + PNGs")
    v.add_argument("run_dir", help="runs/<run-id>")
    v.add_argument("--order", default="A,B,A2", help="control,candidate,control labels (default A,B,A2)")
    _thresholds(v, threshold_defaults("verdict"),
                f"; `gate boot` on the CPU harness: {threshold_defaults('boot')['speed_floor']:g}")
    v.set_defaults(func=_verdict)
    b = gs.add_parser("boot", help="CPU harness: boot control / candidate / control lines of a profile "
                                   "in turn, gate each, judge")
    from adapter.tools.lines import add_cpu_model_arg, add_line_args

    add_line_args(b, against="control", what="the candidate line")
    add_cpu_model_arg(b, ["dense", "swa"], "dense")
    b.add_argument("--suite", choices=sorted(SUITES), default="quick",
                   help="quick (CPU harness, minutes) or full (the cluster's release gate) (default %(default)s)")
    b.add_argument("--out", required=True, help="runs directory (outside the repo, e.g. $TMPDIR/gate-runs)")
    b.add_argument("--run-id", default=None, help="run id (default: UTC date-time); an existing one resumes")
    _thresholds(b, threshold_defaults("boot"), " on the shared-CPU harness")
    b.set_defaults(func=_boot)
