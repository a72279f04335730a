"""Cone replay beside the engine's own SWA bounded replay, on the tiny DeepSeek-V4 in the real CPU
server (issue 43 item 3).

Boots model "dsv4" (adapter/cpu/models.py) with `--enable-decoder-swa-bounded-replay` and, separately,
`--enable-encoder-swa-bounded-replay`, each on stock (no DSV41 key, the control line's CPU args)
and on the production line (.env.tp4.example's keys, dsv4-scaled by canary.model_keys, e.g.
DSV41_SWA_CONE_TOKENS=512), and where a boot comes up runs the lost-window resume
(traffic.dsv4_window_resume) and the idle-session resume (traffic.dsv4_idle_session_resume), then
compares each production boot with the stock boot of the same flag at T=0 (traffic.compare), and
lists cone's plan / copy / fallback lines. `--no-copy` adds the negative control
(DSV41_SWA_CONE_TEST_NO_COPY=1) per flag. One server at a time, each stopped before the next.

A boot that does not come up is reported with the server's own error line (the engine's
refusal of the flag or its assertion): that is the finding, not a harness failure.

    .venv/bin/python bench/cone_bounded_replay.py [--flags decoder encoder] [--lines stock production] [--no-copy] [--json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from adapter.tools import canary, profile, traffic  # noqa: E402

FLAGS = {"decoder": "--enable-decoder-swa-bounded-replay",
         "encoder": "--enable-encoder-swa-bounded-replay"}
PROFILE = pathlib.Path(__file__).resolve().parents[1] / ".env.tp4.example"


def lines() -> dict:
    prod_keys, prod_args, _ = canary.split_line(profile.load_line(PROFILE, "production"))
    _, ctrl_args, _ = canary.split_line(profile.load_line(PROFILE, "control"))
    prod_keys, _ = canary.model_keys("dsv4", prod_keys)
    return {"stock": ({}, ctrl_args), "production": (prod_keys, prod_args),
            "no_copy": ({**prod_keys, "DSV41_SWA_CONE_TEST_NO_COPY": "1"}, prod_args)}


def boot(flag: str, line: str, keys: dict, args: dict, say) -> dict:
    began = time.monotonic()
    run = canary.run_config("dsv4", keys, {**args, FLAGS[flag]: ""}, scenarios=("window", "idle"),
                            progress=say, name=f"dsv4-{flag}-{line}")
    cone = [ln for ln in run.dsv41_lines("swa_cone") if " installed" not in ln]
    return {"flag": FLAGS[flag], "line": line, "up": not any(e.startswith("boot failed") for e in run.errors),
            "errors": run.errors[:3], "exit_code": run.exit_code, "wall_s": round(time.monotonic() - began),
            "window": run.window, "idle": run.idle, "cone_lines": cone, "log_dir": run.log_dir}


def compare(ref: dict, other: dict) -> dict:
    out = {}
    for scen, parts in (("window", ("doc", "resume")), ("idle", None)):
        a, b = ref.get(scen), other.get(scen)
        if not a or not b:
            out[scen] = "not run"
            continue
        keys = parts or [k for k, v in a.items() if isinstance(v, traffic.Record)]
        cmp = traffic.compare([a[k] for k in keys], [b[k] for k in keys])
        out[scen] = f"{cmp.equal}/{cmp.total} equal, max logprob diff {cmp.worst:.3g}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flags", nargs="+", choices=tuple(FLAGS), default=list(FLAGS))
    p.add_argument("--lines", nargs="+", choices=("stock", "production"), default=["stock", "production"])
    p.add_argument("--no-copy", action="store_true", help="also boot the negative control per flag")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    say = (lambda msg: print(f"  .. {msg}", file=sys.stderr, flush=True))
    configs = lines()
    results = []
    for flag in args.flags:
        names = list(args.lines) + (["no_copy"] if args.no_copy else [])
        runs = {name: boot(flag, name, *configs[name], say) for name in names}
        for name, res in runs.items():
            if name != "stock" and "stock" in runs and runs["stock"]["up"] and res["up"]:
                res["vs_stock"] = compare(runs["stock"], res)
            results.append(res)
    if args.json:
        print(json.dumps(results, default=lambda o: getattr(o, "__dict__", str(o)), indent=1))
        return 0
    for res in results:
        print(f"{res['flag']} on {res['line']}: " + ("up" if res["up"] else "did not boot")
              + f" ({res['wall_s']} s)")
        for err in ([] if res["up"] else res["errors"][:1]):
            print(f"    {err.splitlines()[0][:400]}")
        for scen, verdict in res.get("vs_stock", {}).items():
            print(f"    {scen} vs stock with the flag: {verdict}")
        for ln in res["cone_lines"]:
            print(f"    {ln[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
