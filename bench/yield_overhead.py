"""Per-call cost of Scheduler.get_next_batch_to_run wrapped by decode_yield vs stock, in one run.

    .venv/bin/python bench/yield_overhead.py [--calls 2000] [--json]

One real Scheduler (adapter/tools/sims/decode_yield.py `build_scheduler`: the engine's own step on the
real UnifiedRadixCache and pools, CPU) with two streams decoding. The wrapped methods are the ones
the production installer puts in place (installed, captured, undone); the bench then swaps the
three class attributes between the engine's own functions and the wrapped ones before every call,
so stock and wrapped calls interleave one by one on the same scheduler and the same (slowly
growing) state, and a loaded machine's drift hits both alike. Medians over all calls of each.
Only the get_next_batch_to_run call is timed; committing the step's tokens is not.

Two states:
- "decode": nothing chunked, the yield not armed (the path of every ordinary decode step).
- "armed": a chunked prompt mid-prefill and the next chunk deferred. Stock defers through its own
  interval counter (set far out, so stock also decodes on every call); wrapped, the yield is armed
  (its owed steps set far out) and its `_should_defer_prefill` hook answers, calling the engine's
  method alongside. Both states run decode steps of the same two rows.

Ratios printed: wrapped / stock per call of the CPU harness step (no forward pass here), and the
same overhead against a modelled scheduler step of the cluster (that CPU call plus the modelled
decode forward of adapter/decode_yield.py for these rows: the issue's "< 1.01 of a scheduler step").
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from adapter.cpu import cpu_engine  # noqa: E402

cpu_engine.install_torchvision_shim()

from adapter import decode_yield as dy  # noqa: E402
from adapter import installer  # noqa: E402
from adapter.tools.sims import decode_yield as sim  # noqa: E402

FAR = 10**9


def _install(on: bool) -> None:
    state = installer.install_in_process({dy.KEY: "33"} if on else {})[dy.NAME]
    assert state.status == ("installed" if on else "off"), state


ROWS = ("get_next_batch_to_run", "_should_defer_prefill", "_arm_prefill_decode_interval")


def _methods():
    """The engine's own methods and the installer's wrapped ones (installed, captured, undone)."""
    from sglang.srt.managers.scheduler import Scheduler

    _install(False)
    stock = {n: Scheduler.__dict__[n] for n in ROWS}
    _install(True)
    wrapped = {n: Scheduler.__dict__[n] for n in ROWS}
    _install(False)
    assert all(wrapped[n] is not stock[n] for n in ROWS)
    return Scheduler, stock, wrapped


def _one_call(loop) -> int:
    s = loop.s
    t0 = time.perf_counter_ns()
    plan = s.get_next_batch_to_run(s.running_batch, s.last_batch)
    dt = time.perf_counter_ns() - t0
    s.running_batch = plan.running_batch
    batch = plan.batch_to_run
    assert batch is not None and batch.forward_mode.is_decode(), "bench state drifted"
    loop._commit(batch)
    s.last_batch = batch
    return dt


def bench(calls: int) -> dict:
    import logging

    logging.getLogger("sglang.dsv41").setLevel(logging.WARNING)
    cls, stock_fns, wrapped_fns = _methods()
    s = sim.build_scheduler(chunk=512, interval=1, full_tokens=1 << 17, swa_tokens=1 << 15,
                            req_slots=8)
    loop = sim.Loop(s)
    s.__dict__.pop("_should_defer_prefill")      # no observation layer in the timed path
    streams = [sim.make_req(f"s{i}", 2048, max_new_tokens=1 << 30, salt=i + 1) for i in range(2)]
    for r in streams:
        loop.submit(r)
    loop.run_until(lambda: all(len(r.output_ids) >= 2 for r in streams)
                   and not s.waiting_queue and s.chunked_req is None)
    result = {}
    try:
        for state in ("decode", "armed"):
            if state == "armed":
                loop.submit(sim.make_req("p", 8192, max_new_tokens=1, salt=9))
                loop.run_until(lambda: s.chunked_req is not None)    # first chunk scheduled
                # both defer on every call: stock by its own counter, wrapped by the armed yield
                s._prefill_decode_interval_remaining = FAR
                st = dy._state(s)
                st.req, st.left = s.chunked_req, FAR
            times = {"stock": [], "wrapped": []}
            gc.collect()
            gc.disable()
            try:
                for i in range(calls):
                    for kind in (("stock", "wrapped") if i % 2 == 0 else ("wrapped", "stock")):
                        for name, fn in (stock_fns if kind == "stock" else wrapped_fns).items():
                            setattr(cls, name, fn)
                        times[kind].append(_one_call(loop))
            finally:
                gc.enable()
                for name, fn in stock_fns.items():
                    setattr(cls, name, fn)
            stock = statistics.median(times["stock"])
            wrapped = statistics.median(times["wrapped"])
            rows = s.running_batch.reqs
            step_us = dy.step_cost_us(len(rows), sum(r.seqlen for r in rows))
            result[state] = {
                "calls_each": calls,
                "stock_us": round(stock / 1e3, 2), "wrapped_us": round(wrapped / 1e3, 2),
                "overhead_us": round((wrapped - stock) / 1e3, 2),
                "ratio_call": round(wrapped / stock, 4),
                "modelled_step_us": step_us,
                "ratio_step": round((wrapped / 1e3 + step_us) / (stock / 1e3 + step_us), 6),
            }
    finally:
        _install(False)
    # the arming arithmetic done once per non-final chunk
    rows = s.running_batch.reqs
    t0 = time.perf_counter_ns()
    for _ in range(10_000):
        dy.yield_steps(33, dy.pass_cost_us([8192], [400_000]),
                       dy.step_cost_us(len(rows), sum(r.seqlen for r in rows)), 1)
    result["arm_compute_us"] = round((time.perf_counter_ns() - t0) / 10_000 / 1e3, 3)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000, help="timed calls of each, interleaved")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    res = bench(args.calls)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for state in ("decode", "armed"):
        r = res[state]
        print(f"{state:6s}: stock {r['stock_us']:.1f} us/call, wrapped {r['wrapped_us']:.1f} us/call "
              f"(medians, +{r['overhead_us']:.2f} us) -> ratio {r['ratio_call']:.4f} per CPU call; "
              f"{r['ratio_step']:.6f} of a modelled scheduler step ({r['modelled_step_us']} us "
              f"forward), {r['calls_each']} calls each")
    print(f"arming arithmetic once per non-final chunk: {res['arm_compute_us']:.3f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
