"""Decode yield against the engine's own knobs an operator reaches for first (issue 43 item 2, the
yield half only; partial: see docs/performance.md).

    .venv/bin/python bench/yield_alternatives.py [--lines stock pdi8 pdi16 mixed half yield] [--yield-model V] [--json]

One boot per line of the dense tiny CPU model (adapter/cpu/models.py), one at a time, each with the
control line's CPU launch args (canary.MODEL_ARGS["dense"]: 4096-token chunks,
--prefill-decode-interval 1) and exactly one change:

  stock   nothing (the control line)
  pdi8    --prefill-decode-interval 8 (SGLang PR #40443 would make it the V4.1 default)
  pdi16   --prefill-decode-interval 16
  mixed   --enable-mixed-chunk
  half    --chunked-prefill-size 2048 (half the chunk)
  yield   DSV41_DECODE_YIELD=33 with DSV41_DECODE_YIELD_MODEL=--yield-model (this machine's fit,
          bench/yield_calibration.py dense)

Each runs traffic.yield_cadence (2 greedy streams, then a 24,576-token prompt; the streams' token
rate during the prefill over their rate before it, from the streamed tokens' client timestamps; the
long prompt's time to its one token, `prefill_s`), and reads
the engine's own step timings for the yield line (decode_yield's per-prompt line). Prints one row per
line. Wall-clock figures of a shared 2-core machine: a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from adapter.tools import canary, profile  # noqa: E402

LINES = {
    "stock": ({}, {}),
    "pdi8": ({}, {"--prefill-decode-interval": "8"}),
    "pdi16": ({}, {"--prefill-decode-interval": "16"}),
    "mixed": ({}, {"--enable-mixed-chunk": ""}),
    "half": ({}, {"--chunked-prefill-size": "2048"}),
    "yield": ({"DSV41_DECODE_YIELD": "33"}, {}),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lines", nargs="+", choices=tuple(LINES), default=list(LINES))
    p.add_argument("--yield-model", help="DSV41_DECODE_YIELD_MODEL for the yield line")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    _, ctrl_args, _ = canary.split_line(profile.load_line(REPO / ".env.tp4.example", "control"))
    rows = []
    for name in a.lines:
        keys, change = LINES[name]
        keys = dict(keys)
        if name == "yield" and a.yield_model:
            keys["DSV41_DECODE_YIELD_MODEL"] = a.yield_model
        run = canary.run_config("dense", keys, {**ctrl_args, **change}, scenarios=("cadence",),
                                progress=lambda m: print(f"  .. {m}", file=sys.stderr, flush=True),
                                name=f"dense-{name}")
        row = {"line": name, "change": change or keys or "none", "errors": run.errors[:2]}
        if run.cadence:
            row.update({k: run.cadence[k] for k in ("cadence", "prefill_s", "rate_before_tok_s",
                                                    "rate_during_tok_s", "long_prompt_completed")})
        if keys:
            row.update({k: v for k, v in canary.yield_shares(run).items()
                        if k in ("achieved_share_engine", "achieved_share_engine_per_prompt")})
        rows.append(row)
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'line':7s} {'change':42s} {'stream rate during/before':>26s} {'long prompt s':>14s}  engine share")
    for r in rows:
        change = json.dumps(r["change"]) if r["change"] != "none" else "none"
        print(f"{r['line']:7s} {change[:42]:42s} {r.get('cadence', float('nan')):26.3f} "
              f"{r.get('prefill_s', float('nan')):14.1f}  {r.get('achieved_share_engine', '')}"
              + (f"  ERROR {r['errors'][0][:200]}" if r["errors"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
