"""What swan's router costs the host per decode call it serves, on CPU.

    .venv/bin/python bench/swan_router.py [--rounds 21] [--calls 2000] [--rows 4] [--heads 64]

Every decode attention call (43 per forward) passes through the router that swan hooks onto the
engine's `flash_mla_with_kvcache_sm120`. In a CUDA-graph replay no Python runs; in every forward
that is not a replay (graph capture, eager batch sizes) the router's cost is paid 43 times.

The real kernel needs an SM12x GPU, so the kernel layer is stood in: its plan is a fixed served
plan and its run returns at once (the real run allocates the outputs and launches; not measured
here). The call is the engine's: the ten keyword arguments deepseek_v4_backend passes, CPU tensors
of the production shapes (q [rows, 1, heads, 512] bf16, the 256-token SWA pool view, indices
[rows, 1, 128], the compressed cache with 512 extra candidates, lengths, sink). CPU tensors are
not served by routing (`tensors on cpu`), so each variant is given the verdict of the call's
CUDA twin (the same facts on an sm_121 device, routed by the real route()):
  * after: the installed router's hook (adapter/swan/__init__.py, called as the engine's wrapper
    calls it: hook(original, **kwargs)): one native lookup (runtime/swan256/router_key.cpp, the
    module's router key, built by scripts/build_swan.sh: the call's exact metadata key and the
    decision kept for it), the engine's backend, the served count, the kernel's run; its decision
    for this call's key taken from the twin (what the first call of the key leaves behind); this
    is the steady state of every served call;
  * before: the router's per-call path before issue 24.5 (commit 9968fa7), copied here: describe
    the call in full (describe_call), route the twin's facts (what route() costs on a served
    call), key the plan cache on dataclasses.astuple(facts), count, run. describe_call and
    route are today's (unchanged but for route's first checks moving into entry_reason and its
    device scan no longer calling dataclasses.fields: if anything, "before" reads low).
Both in one process, interleaved rounds, medians. Printed: per served call, per forward of 43
layers, the ratio, the parts of each path, and the cost of one torch metadata read (q.shape) in
the same run, so the figures can be read on another machine as a count of such reads.

The `router:` line is the router's own cost: the hook's time less a keyword call of a function
with the stock entry's signature (`def entry(**kwargs)`) given the same ten arguments, which the
engine pays on every call of `flash_mla_with_kvcache_sm120(**kwargs)` with or without swan (the
hook wrapper's own toll is bench/hook_overhead.py's). The hook's full time is printed beside it.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import pathlib
import statistics
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from adapter import receipts, swan  # noqa: E402
from adapter.swan.layout import PAGE_STRIDE, PAGE_TOKENS, ROW_BYTES, SPLIT_PAGE_STRIDE  # noqa: E402

LAYERS = 43


def engine_call(rows: int, heads: int, topk: int = 128, extra_topk: int = 512, pages: int = 8) -> dict:
    """The keyword arguments deepseek_v4_backend passes to flash_mla_with_kvcache_sm120."""
    pool = torch.zeros(pages * PAGE_STRIDE, dtype=torch.uint8)
    extra = torch.zeros(pages * SPLIT_PAGE_STRIDE, dtype=torch.uint8)
    return dict(
        q=torch.zeros(rows, 1, heads, 512, dtype=torch.bfloat16),
        k_cache=pool.as_strided((pages, PAGE_TOKENS, 1, ROW_BYTES),
                                (PAGE_STRIDE, ROW_BYTES, ROW_BYTES, 1)).view(torch.float8_e4m3fn),
        head_dim_v=512, softmax_scale=512 ** -0.5,
        indices=torch.full((rows, 1, topk), -1, dtype=torch.int32),
        topk_length=torch.full((rows,), topk, dtype=torch.int32),
        attn_sink=torch.zeros(heads, dtype=torch.float32),
        extra_k_cache=extra.as_strided((pages, 64, 1, ROW_BYTES),
                                       (SPLIT_PAGE_STRIDE, ROW_BYTES, ROW_BYTES, 1)).view(torch.float8_e4m3fn),
        extra_indices_in_kvcache=torch.full((rows, 1, extra_topk), -1, dtype=torch.int32),
        extra_topk_length=torch.full((rows,), extra_topk, dtype=torch.int32))


def cuda_twin(facts: swan.CallFacts) -> swan.CallFacts:
    """The same call's facts on an sm_121 device (what routing sees on GB10)."""
    moved = {name: dataclasses.replace(getattr(facts, name), device="cuda")
             for name in swan.routing.TENSOR_FIELDS if getattr(facts, name) is not None}
    return dataclasses.replace(facts, capability=(12, 1), **moved)


class StandInKernel(swan.Kernel):
    """The real Kernel's plan cache, with the GPU parts stood in: a fixed served plan, a run that
    returns at once."""

    def __init__(self):                     # no .so to load on CPU
        self._plans = {}

    def _resolve(self, f, kwargs):
        return swan.Plan(None, {"cpb": 1, "partial_bytes": 0, "lse_bytes": 0})

    def run(self, plan, kwargs):
        return (None, None)


class BeforeRouter:
    """The per-call path of adapter/swan.py's _Router before issue 24.5 (commit 9968fa7), with
    route() given the CUDA twin's facts (the bench's one change: CPU tensors are not served) and
    the plan cache keyed as it was, on dataclasses.astuple(facts)."""

    def __init__(self, ctx, caps, kernel, twin):
        self.ctx, self.caps, self.kernel, self.twin = ctx, caps, kernel, twin
        self.plans = {}
        self.first_served = True

    def backend(self) -> str:
        return str(getattr(sys.modules[swan.ENGINE_MODULE], "_sm120_default_backend", "unknown"))

    def plan(self, f, kwargs):
        key = dataclasses.astuple(f)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = self.kernel._resolve(f, kwargs)
        return plan

    def __call__(self, original, *args, **kwargs):
        facts = swan.describe_call(args, kwargs, self.backend())
        reason = swan.route(self.twin, self.caps)
        plan = None
        if reason is None:
            plan = self.plan(facts, kwargs)
            reason = plan.reason
        if reason is not None:
            self.ctx.fallback(reason)
            return original(*args, **kwargs)
        self.ctx.counters["served"] += 1
        return self.kernel.run(plan, kwargs)


def per_call_us(fn, calls: int) -> float:
    """Mean microseconds per call over `calls` calls, the garbage collector off (as timeit does:
    a collection that one variant's garbage triggers would otherwise land in another's loop)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        return (time.perf_counter_ns() - start) / calls / 1000.0
    finally:
        gc.enable()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant per round")
    ap.add_argument("--rows", type=int, default=4, help="query rows (DSpark verify: 4)")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)

    # The engine module the router reads its SM120 backend from (not imported: only that attribute).
    engine = types.ModuleType(swan.ENGINE_MODULE)
    engine._sm120_default_backend = "flashinfer"
    sys.modules.setdefault(swan.ENGINE_MODULE, engine)
    ctx = types.SimpleNamespace(counters=receipts.counters[swan.NAME],
                                fallback=lambda reason: receipts.fallback(swan.NAME, reason))
    # The built module's native key (scripts/build_swan.sh); the rest of the module is stood in.
    built = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
    native = swan.load_router_key(built)
    info = swan.ModuleInfo(pathlib.Path("."), pathlib.Path("swan256.so"), "0" * 64, "0.7.2",
                           ("sm_120a", "sm_121a"), swan.HEAD_KERNELS, {}, built.router_key_path)
    kw = engine_call(args.rows, args.heads)
    facts = swan.describe_call((), kw, "flashinfer")
    twin = cuda_twin(facts)
    caps = swan.ModuleCaps(heads=info.heads, archs=info.archs)
    assert swan.route(twin, caps) is None, swan.route(twin, caps)
    assert swan.route(facts, caps) == "tensors on cpu, not CUDA"

    after = swan._Router(ctx, info, StandInKernel(), native)
    after.first_served = True              # the receipt line of the first served call is not timed
    q = kw["q"]
    slot, key = native.lookup(kw, {})     # the miss the first call of this key on GB10 meets
    after._native_decisions[slot] = (key, _served_decision(after, twin, kw))
    before = BeforeRouter(ctx, caps, StandInKernel(), twin)

    def entry(**kwargs):                  # the stock entry's signature: what any call of it costs
        return None

    def original(*a, **k):
        raise AssertionError("a served call reached the stock entry")

    served_before = receipts.counters[swan.NAME]["served"]
    variants = {
        "after": lambda: after.hook(original, **kw),       # what the engine's wrapper calls
        "before": lambda: before(original, **kw),
    }
    parts = {
        "native lookup": lambda: native.lookup(kw, after._native_decisions),
        "keyword call": lambda: entry(**kw),
        "python decode_key": lambda: swan.decode_key(q.shape, kw),
        "describe_call": lambda: swan.describe_call((), kw, "flashinfer"),
        "route(served)": lambda: swan.route(twin, caps),
        "astuple(facts)": lambda: dataclasses.astuple(facts),
        "q.shape": lambda: q.shape,
        "empty call": lambda: None,
    }
    samples = {name: [] for name in [*variants, *parts]}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            samples[name].append(per_call_us(variants[name], args.calls))
        for name, fn in parts.items():
            samples[name].append(per_call_us(fn, args.calls))
    # net of the timing loop's own lambda call (the "empty call" part)
    empty = statistics.median(samples.pop("empty call"))
    med = {name: statistics.median(v) - empty for name, v in samples.items()}
    served = receipts.counters[swan.NAME]["served"] - served_before
    assert served == 2 * args.rounds * args.calls, served     # every timed call was served
    attr_us = med["q.shape"]
    own = med["after"] - med["keyword call"]
    report = {
        "router_us": round(own, 2), "router_per_forward_us": round(own * LAYERS, 1),
        "rows": args.rows, "heads": args.heads, "rounds": args.rounds, "calls": args.calls,
        "torch": torch.__version__, "python": sys.version.split()[0],
        "median_us": {k: round(v, 3) for k, v in med.items()}, "loop_us": round(empty, 3),
        "after_us": round(med["after"], 2), "before_us": round(med["before"], 2),
        "after_per_forward_us": round(med["after"] * LAYERS, 1),
        "before_per_forward_us": round(med["before"] * LAYERS, 1),
        "before_over_after": round(med["before"] / med["after"], 1),
        "after_in_q_shape_reads": round(med["after"] / attr_us, 1),
    }
    print("parts (median us per call): " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()
                                                     if k not in variants))
    print(f"before: {med['before']:.2f} us per served call, {med['before'] * LAYERS:.0f} us per "
          f"forward of {LAYERS} layers")
    print(f"after: {med['after']:.2f} us per served call through the hook ({med['after'] * LAYERS:.0f} us "
          f"per forward of {LAYERS} layers; before/after {report['before_over_after']}x; = "
          f"{report['after_in_q_shape_reads']} x the cost of one q.shape read here)")
    print(f"router: {own:.2f} us per served call ({own * LAYERS:.0f} us per forward of {LAYERS} layers; "
          f"the hook's {med['after']:.2f} us less {med['keyword call']:.2f} us, the engine's keyword "
          f"call of the entry)")
    if args.json_out:
        pathlib.Path(args.json_out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _served_decision(router, twin, kw):
    """The decision the router keeps after the first call of this key on GB10: route() on the
    CUDA twin (None), the kernel's plan for it."""
    assert swan.route(twin, router.caps) is None
    plan = router.kernel.plan(twin, kw)
    return swan._Decision(plan.reason, plan, twin)


if __name__ == "__main__":
    sys.exit(main())
