"""`dsv41 gate boot`: an A/B/A on this CPU machine in one command.

Boots the profile's control line (label A), its candidate line (B), the control line again (A2),
one at a time, each a real `sglang.launch_server` (adapter/cpu/server.py: CpuServer), and runs
`gate run` against each; then `gate verdict`. Only a line's DSV41_* keys and the launch args that
mean the same on one CPU rank are used (adapter/tools/lines.py: split_line), over the CPU
model's args (lines.MODEL_ARGS) and the gate's own (`GATE_ARGS`). A label already measured in
full under the run id is not booted again (resume).
"""
from __future__ import annotations

import datetime
import json
import re
import sys
import time
from typing import Optional

from adapter.tools.gate import cells as C
from adapter.tools.gate import run as gate_run

# The speed floor of the verdict on this harness: 2 cores shared with other jobs swing a boot's
# tokens/s by up to ~2x (measured: controls 196 / 104 tok/s at load 6.6), so the CPU gate catches
# only gross regressions (a candidate below 0.35 x the controls' mean; the planted step delay is ~9x).
CPU_SPEED_FLOOR = 0.65
# The T=1 check's alpha on this harness: two chi-square families per verdict (controls alike,
# candidate alike), each Bonferroni over the prompts, so a verdict on equal boots is a false
# INVALID or KILL with probability <= 2 x alpha = 4e-5 (< 1 in 10,000 runs). The default 0.01 gave
# a false alarm in ~2-3 % of CPU runs (issue 40). The planted regressions of the tests (other
# weights) sit at p < 1e-30. Every boot also gets the same --random-seed (GATE_ARGS).
CPU_T1_ALPHA = 2e-5
# The same on all three boots: a 8K context (cells sized from it stay small on 2 cores; a 16K pool
# that the resume cell can evict in about a second), a chat template (the tiny tokenizer has none),
# cached_tokens in `usage`, one token per stream event (timestamps that do not lag), /metrics for
# the soak's sampler.
GATE_ARGS = {"--context-length": "8192", "--max-total-tokens": "16384", "--chat-template": "chatml",
             "--enable-cache-report": "", "--incremental-streaming-output": "", "--enable-metrics": "",
             "--random-seed": "1"}


def server_args(model: str, args: dict) -> dict:
    """The CPU model's args, the gate's, then the line's. One served model name on every boot (the
    verdict refuses to compare boots that served different names)."""
    from adapter.tools.lines import MODEL_ARGS

    merged = dict(MODEL_ARGS[model])
    merged.update(GATE_ARGS)
    merged["--served-model-name"] = f"dsv41-cpu-{model}"
    merged.update(args)
    return merged


def boot_and_run(label: str, model: str, keys: dict, args: dict, out: str, run_id: str,
                 suite: str = "quick", extra_env: Optional[dict] = None, progress: bool = True,
                 model_path: Optional[str] = None) -> dict:
    """Boot one configuration, gate it, stop it (whole process group, even on failure).

    extra_env: harness switches (DSV41CPU_*, e.g. the planted step delay); model_path: another
    model directory of the same shape served under the same name (tests: other weights)."""
    from adapter.cpu.server import CpuServer

    label_dir = gate_run.pathlib.Path(out) / run_id / label
    record = {"label": label, "model": model, "keys": dict(keys), "args": dict(args),
              "extra_env": dict(extra_env or {}), "label_dir": str(label_dir)}
    if gate_run.label_complete(label_dir):
        record["skipped"] = "measured already"
        return record
    launch = server_args(model, args)
    if model_path:
        launch["--model-path"] = str(model_path)      # after the harness's own: the last one wins
        record["model_path"] = str(model_path)
    server = CpuServer(model, keys=keys, args=launch, extra_env=dict(extra_env or {}),
                       name=re.sub(r"[^A-Za-z0-9_.-]+", "-", f"gate-{label}"))
    try:
        server.start()
        record["boot_s"] = round(server.boot_s, 1)
        began = time.monotonic()
        gate_run.run_gate(server.url, label, out, suite=suite, run_id=run_id, progress=progress,
                          server_pid=server.proc.pid)
        record["measure_s"] = round(time.monotonic() - began, 1)
    finally:
        server.stop()
        record["log_dir"] = str(server.log_dir)
    (label_dir / "boot.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def main(args) -> int:
    from adapter import keys as key_registry
    from adapter.cpu.server import BootError
    from adapter.tools import profile
    from adapter.tools.gate import verdict
    from adapter.tools.lines import load_checked_lines, split_line

    try:
        control, candidate = load_checked_lines(args.profile, args.against, args.line)
    except (OSError, profile.ProfileError, key_registry.ConfigError) as exc:
        print(f"dsv41 gate boot: {exc}", file=sys.stderr)
        return 2
    ctrl_keys, ctrl_args, _ = split_line(control)
    cand_keys, cand_args, _ = split_line(candidate)
    run_id = args.run_id or datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    boots = []
    try:
        for label, k, a in (("A", ctrl_keys, ctrl_args), ("B", cand_keys, cand_args), ("A2", ctrl_keys, ctrl_args)):
            print(f"[gate boot] {label}: {args.against if label != 'B' else args.line} line, "
                  f"{args.model} model", file=sys.stderr, flush=True)
            boots.append(boot_and_run(label, args.model, k, a, args.out, run_id, suite=args.suite))
    except (C.GateError, BootError) as exc:
        print(f"dsv41 gate boot: {exc}", file=sys.stderr)
        from adapter.tools import exits

        return exits.REFUSED if "refused to install" in str(exc).split("\n", 1)[0] else exits.USAGE
    for b in boots:
        print(f"[gate boot] {b['label']}: " + (b.get("skipped") or f"boot {b['boot_s']}s, measured "
                                                 f"{b['measure_s']}s"), file=sys.stderr)
    floor = CPU_SPEED_FLOOR if args.speed_floor is None else args.speed_floor
    thresholds = {k: getattr(args, k, None) for k in ("kld_long", "kld_short", "t1_alpha", "max_excluded")}
    if thresholds["t1_alpha"] is None:
        thresholds["t1_alpha"] = CPU_T1_ALPHA
    return verdict.main(verdict_args(gate_run.pathlib.Path(args.out) / run_id, "A,B,A2", args.json, floor,
                                     **thresholds))


def verdict_args(run_dir, order: str, as_json: bool, speed_floor: Optional[float] = None, **thresholds):
    import argparse

    fields = dict(kld_long=None, kld_short=None, t1_alpha=None, max_excluded=None)
    fields.update(thresholds)
    return argparse.Namespace(run_dir=str(run_dir), order=order, json=as_json, speed_floor=speed_floor, **fields)
