"""Fit decode yield's cost model to this machine: one CPU server boot with the calibration traffic,
then `dsv41 calibrate yield` on that boot's scheduler log (issue 43).

    .venv/bin/python bench/yield_calibration.py dense|dsv4 [--json]

Boots the CPU model with DSV41_DECODE_YIELD=33 and the production line's CPU launch args (the
canary's MODEL_ARGS: 4096-token chunks on dense, 1024 on dsv4), sends traffic.calibration_run
(dense) / traffic.dsv4_calibration_run (dsv4): lone long prompts, then decode runs of 1, 2 and 4
rows, each alone after a cache flush; stops the server; fits its scheduler log. Prints the fit's
report, ending with the DSV41_DECODE_YIELD_MODEL=... value to put beside DSV41_DECODE_YIELD in a
copy of the profile (docs/decode_yield.md, "On this machine"). The log is copied to --keep-log.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapter.tools import calibrate, canary, profile  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", choices=("dense", "dsv4"))
    p.add_argument("--keep-log", help="copy the scheduler log here")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    _, prod_args, _ = canary.split_line(profile.load_line(REPO / ".env.tp4.example", "production"))
    args = {**canary.MODEL_ARGS[a.model], **prod_args}
    run = canary.run_config(a.model, {"DSV41_DECODE_YIELD": "33"}, args, scenarios=("calibration",),
                            progress=lambda m: print(f"  .. {m}", file=sys.stderr, flush=True),
                            name=f"{a.model}-calibration")
    if run.errors:
        print("\n".join(run.errors), file=sys.stderr)
        return 1
    pids = [role.rsplit(" pid ", 1)[1] for role in run.logs if role.startswith("sglang::scheduler")]
    log = pathlib.Path(run.log_dir) / f"{pids[0]}.log"
    if a.keep_log:
        shutil.copy(log, a.keep_log)
    result = calibrate.fit([log])
    print(json.dumps(result, indent=1) if a.json else calibrate.format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
