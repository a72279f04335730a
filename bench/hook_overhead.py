"""Per-call cost of a hooked engine callable: bare, as installed now, and as installed before
issue 24 (every hook wrapped by metrics.watch, a settle check on each call).

The engine callable is the real `ScheduleBatch.batch_size` (a one-line method), hooked through the
engine's own HookRegistry wrapper (`_wrap_fn`, AROUND) with a pass-through hook, which is what an
adapter hook costs before its own work. "before" re-creates the removed layer exactly
(metrics.watch of v2.6.4 before issue 24: a global check, then the hook). Interleaved rounds,
median ns per call.

    .venv/bin/python bench/hook_overhead.py [--rounds 15] [--calls 200000] [--json]
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import timeit

_state = True       # metrics settled, as in a serving process


def _settle():      # never reached once settled; kept so the "before" frame is the real shape
    pass


def watch(hook):    # the removed layer (adapter/metrics.py before issue 24)
    @functools.wraps(hook)
    def settling(original, *args, **kwargs):
        if _state is None:
            _settle()
        return hook(original, *args, **kwargs)

    return settling


def pass_through(original, *args, **kwargs):
    return original(*args, **kwargs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--calls", type=int, default=200_000, help="calls per variant per round")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    bare = ScheduleBatch.batch_size
    variants = {
        "bare": bare,
        "after": _wrap_fn(bare, pass_through, HookType.AROUND),
        "before": _wrap_fn(bare, watch(pass_through), HookType.AROUND),
    }
    batch = ScheduleBatch.__new__(ScheduleBatch)
    batch.reqs = [object()] * 4
    per_call = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            seconds = timeit.timeit(lambda fn=fn: fn(batch), number=args.calls)
            per_call[name].append(seconds / args.calls * 1e9)
    med = {name: statistics.median(v) for name, v in per_call.items()}
    out = {"ns_per_call": {k: round(v, 1) for k, v in med.items()},
           "hook_toll_ns": {"before": round(med["before"] - med["bare"], 1),
                            "after": round(med["after"] - med["bare"], 1)},
           "removed_ns": round(med["before"] - med["after"], 1),
           "rounds": args.rounds, "calls": args.calls}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"bare engine callable     {med['bare']:7.1f} ns/call")
        print(f"hooked, after (now)      {med['after']:7.1f} ns/call  (+{out['hook_toll_ns']['after']:.1f})")
        print(f"hooked, before (watch)   {med['before']:7.1f} ns/call  (+{out['hook_toll_ns']['before']:.1f})")
        print(f"removed per hooked call: {out['removed_ns']:.1f} ns (median of {args.rounds} "
              f"interleaved rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
