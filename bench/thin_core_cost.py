"""What thin's tree core costs in scheduler time, vs the engine-default Rust core.

One run, four caches with the same realistic tree, built by the same requests through the
engine's own entry points (adapter/tools/sims/swa_thin.py Driver): two idle sessions (330K / 300K
tokens, 8192-token chunks + agent turns), two 500K sessions, one 100K session and 40 sub-agents x
3 turns on a shared system prompt, on the 384-tail pool (182,784 SWA slots, 3,444,224 full tokens).
  rust    : engine default, no adapter
  python  : the engine's Python core, no adapter
  thin    : DSV41_SWA_THIN=1, as production runs it: thin's own core ("dsv41_thin",
            adapter/swa_thin/core.py) + the reorder hook (through the core's demote_swa_lru)
  thin_py : reference, thin before issue 25: the engine's Python core + the reorder hook
            (swa_thin.OWN_CORE off; extra columns at the right)
Then the cache operations a scheduler step runs are timed on each (CPU wall time of this machine;
no GPU work is involved in any of them). The variants are interleaved: every round measures each
variant once, in a rotated order (rust/python/thin/thin_py, python/thin/thin_py/rust, ...), switching the adapter
install between them with the production installer, so contention from other work on the machine
falls on every variant alike. Printed: medians over the rounds and, for the ratios, the median and
min-max of the per-round ratios (the spread).
  match hit    match_prefix of a 500K session's context + a new turn (admission / waiting queue)
  match miss   match_prefix of an 8K prompt sharing only the system prompt
  chunk ckpt   one 8192-token chunk of a request at depth ~500K (the next chunk of a live prefill:
               PrefillAdder.add_chunked_req, evict_from_tree_cache + slot allocation,
               checkpoint_kv_cache = insert + re-lock + thin's move)
  swa evict    evict(swa_num_tokens=512) on a tree full of passed checkpoints
  lock/unlock  lock + unlock of the 500K session's node
  decode short one decode block (128 tokens) of a request at that depth whose page allocation is
               short: evict_from_tree_cache + allocation + evict_sliding_windows
Per step: a prefill step = 1 chunk ckpt + 4 match miss (waiting queue); a decode step touches the
tree only when allocation is short (old row: 1 swa evict; by depth: decode short). Chunk ckpt and
decode short are measured at ~100K and ~500K depth (the request grows by one chunk / block per
round).
Goals (issue 25), thin/rust as the median of the per-round ratios: chunk ckpt <= 2.0 at ~500K and
<= 1.5 at ~100K, match hit <= 2, lock/unlock <= 3, decode short <= 1.2 (both depths). The bench
prints each goal, met or missed, and for a missed one a profile of thin's operation (where the
remaining time goes).

    .venv/bin/python bench/thin_core_cost.py [--repeats N] [--profile N]
"""
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = ("rust", "python", "thin", "thin_py")
ENV = {"rust": {}, "python": {}, "thin": {"DSV41_SWA_THIN": "1"}, "thin_py": {"DSV41_SWA_THIN": "1"}}
DEPTHS = {"100K": "mid", "500K": "big1"}
# (operation, thin/rust limit): median of the per-round ratios (issue 25).
GOALS = (("chunk ckpt 500K", 2.0), ("chunk ckpt 100K", 1.5), ("match hit", 2.0),
         ("lock/unlock", 3.0), ("decode short 100K", 1.2), ("decode short 500K", 1.2))


def use(variant: str) -> None:
    """Install what `variant` runs with (thin's hooks on or off), as the production installer does."""
    from adapter import installer

    installer.install_in_process(ENV[variant])


def build(variant: str):
    from adapter import swa_thin
    from adapter.cpu import cpu_engine
    from adapter.tools.sims import swa_thin as sim

    use(variant)
    swa_thin.OWN_CORE = variant != "thin_py"       # thin_py: the engine's Python core under thin
    try:
        cpu = cpu_engine.build_swa_cache(full_tokens=3_444_224, swa_tokens=sim.swa_slots(384),
                                         backend="python" if variant == "python" else "rust",
                                         req_slots=12, max_context_len=800_000,
                                         chunked_prefill_size=8192)
    finally:
        swa_thin.OWN_CORE = True
    drv = sim.Driver(cpu, concurrency=4)
    tok = sim.Tokens()
    ctxs = {}
    jobs = []
    for name, first, turns in (("idle0", 200_000, 17), ("idle1", 200_000, 13),
                               ("big0", 500_000, 0), ("big1", 500_000, 0), ("mid", 100_000, 0)):
        ctxs[name] = array("q")
        jobs.append(sim.session(drv, name, tok, ctxs[name], [first] + [6000] * turns, 768))
    drv.run(jobs)
    system = tok.fresh(12_288)
    drv.run([sim.session(drv, f"sub{j}", tok, array("q", system), [6000] * 3, 768) for j in range(40)])
    return cpu, drv, tok, ctxs, system


class Bench:
    """One variant's cache and the live requests its rounds step (same tokens in every variant)."""

    def __init__(self, variant: str, rounds: int):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.variant = variant
        self.cpu, self.drv, tok, ctxs, system = build(variant)
        self.cache = self.cpu.cache
        self.core = type(self.cache.tree_core).__name__
        self.hit_key = RadixKey(ctxs["big0"] + tok.fresh(2000))
        self.miss_key = RadixKey(system + tok.fresh(8192))
        self.node = self.cache.match_prefix(MatchPrefixParams(key=self.hit_key)).last_device_node
        # Count page allocations, to tell a decode block that had to allocate from one that did not.
        self.allocs = 0
        alloc = self.cpu.alloc

        def counting_alloc(n):
            self.allocs += 1
            return alloc(n)

        self.cpu.alloc = counting_alloc
        # Thin's own work inside its hook (the reorder), timed apart from the engine's insert.
        self.move_s = 0.0
        if variant in ("thin", "thin_py"):
            from adapter import swa_thin

            move = swa_thin.move_passed_checkpoint
            cache = self.cache

            def timed_move(*args):
                if args[0] is not cache:          # the other thin variant's cache
                    return move(*args)
                t = time.perf_counter()
                try:
                    return move(*args)
                finally:
                    self.move_s += time.perf_counter() - t

            swa_thin.move_passed_checkpoint = timed_move
        # Live requests, advanced past admission (untimed): per depth one chunked prefill with a
        # chunk left for every round, and one request in decode.
        self.chunked, self.decoding = {}, {}
        for depth, name in DEPTHS.items():
            prompt = ctxs[name] + tok.fresh(8192 * (rounds + 2))
            self.chunked[depth] = self.drv.turn(f"chunked{depth}", prompt, array("q"))
            next(self.chunked[depth])                    # admission + first chunk
            self.decoding[depth] = self.drv.turn(f"decode{depth}", ctxs[name] + tok.fresh(2000),
                                                 tok.fresh(256 * (rounds + 2)))
            next(self.decoding[depth])                   # admission + the 2000-token prefill
        self.times: dict[str, list[float]] = {}

    def timed(self, op: str, fn) -> None:
        t = time.perf_counter()
        fn()
        self.times.setdefault(op, []).append(time.perf_counter() - t)

    def chunk_step(self, depth: str) -> None:
        before, move_before = len(self.drv.trace), self.move_s
        self.timed(f"chunk ckpt {depth}", lambda: next(self.chunked[depth]))
        self.times.setdefault(f"thin move {depth}", []).append(self.move_s - move_before)
        if len(self.drv.trace) != before + 1:
            raise RuntimeError(f"{self.variant}: chunk step at {depth} made no checkpoint "
                               "(the adder let it wait)")

    def decode_short_step(self, depth: str) -> None:
        """Step decode blocks until one allocates; time that one (others are not 'short')."""
        for _ in range(4):
            before = self.allocs
            t = time.perf_counter()
            next(self.decoding[depth])
            dt = time.perf_counter() - t
            if self.allocs > before:
                self.times.setdefault(f"decode short {depth}", []).append(dt)
                return
        raise RuntimeError(f"{self.variant}: no decode block allocated at {depth}")

    def round(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

        cache = self.cache
        self.timed("match hit", lambda: cache.match_prefix(MatchPrefixParams(key=self.hit_key)))
        self.timed("match miss", lambda: cache.match_prefix(MatchPrefixParams(key=self.miss_key)))
        self.timed("lock/unlock", lambda: cache.unlock(cache.lock(self.node)))
        for depth in DEPTHS:
            self.chunk_step(depth)
            self.decode_short_step(depth)
        self.timed("swa evict", lambda: cache.evict(EvictParams(swa_num_tokens=512)))


def per_round(benches: dict, op: str, num: str = "thin", den: str = "rust") -> list[float]:
    return [a / b for a, b in zip(benches[num].times[op], benches[den].times[op])]


def profile_op(bench, op: str, top: int = 15) -> None:
    """cProfile of a few more of thin's `op` (a missed goal): where its time goes."""
    import cProfile
    import pstats

    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    use(bench.variant)
    cache = bench.cache
    if op.startswith("chunk ckpt"):
        run = lambda: next(bench.chunked[op.split()[-1]])   # noqa: E731
    elif op.startswith("decode short"):
        run = lambda: bench.decode_short_step(op.split()[-1])   # noqa: E731
    elif op == "match hit":
        run = lambda: cache.match_prefix(MatchPrefixParams(key=bench.hit_key))   # noqa: E731
    else:
        run = lambda: cache.unlock(cache.lock(bench.node))   # noqa: E731
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(EXTRA_STEPS):
        run()
    prof.disable()
    print(f"\nprofile of the missed goal: thin, {EXTRA_STEPS} x {op}, top {top} by own time")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


EXTRA_STEPS = 5         # chunks / decode blocks each live request keeps for profiles


def run_rounds(benches: dict, rounds: int) -> None:
    for r in range(rounds):
        for i in range(len(VARIANTS)):
            variant = VARIANTS[(r + i) % len(VARIANTS)]     # rotated order: no variant always first
            use(variant)
            benches[variant].round()
    for b in benches.values():
        b.cache.sanity_check()


def profile(benches: dict, rounds: int, top: int) -> None:
    """cProfile of thin's chunk checkpoints at 500K depth (the costly path), top entries by tottime."""
    import cProfile
    import pstats

    use("thin")
    bench = benches["thin"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(rounds):
        next(bench.chunked["500K"])
    prof.disable()
    print(f"\nprofile: thin, {rounds} chunk checkpoints at ~500K depth, top {top} by own time")
    stats = pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime")
    stats.print_stats(top)
    print("thin's own functions in the same profile (cumulative time includes the engine's "
          "checkpoint_into_tree under the hook):")
    stats.sort_stats("cumulative").print_stats("swa_thin")


def _ratio_cell(num: list[float], den: list[float]) -> str:
    per_round = [a / b for a, b in zip(num, den)]
    return f"{statistics.median(per_round):5.2f} ({min(per_round):.2f}-{max(per_round):.2f})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15, help="rounds (each variant once per round)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="then profile thin's chunk checkpoints at 500K depth; print the top N")
    args = ap.parse_args(argv)
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    import torch

    # One torch thread: the tensor copies the scheduler's cache calls make here run on the GPU in
    # production; spread over this machine's shared cores they would wait for each other.
    torch.set_num_threads(1)
    from adapter import receipts

    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger(receipts.LOGGER_NAME).setLevel(logging.WARNING)   # an install line per switch

    extra = 2 * EXTRA_STEPS         # --profile, and a profile per missed goal
    benches = {v: Bench(v, args.repeats + extra) for v in VARIANTS}
    # The four trees share this process: a full collection would scan all of them and land on
    # whichever variant triggered it. Freeze what the builds left, as the engine's freeze_gc does
    # with its startup state (so the Python core's GC load on a growing tree is not counted).
    gc.collect()
    gc.freeze()
    run_rounds(benches, args.repeats)
    med = {v: {op: statistics.median(ts) for op, ts in b.times.items()} for v, b in benches.items()}
    for v in VARIANTS:       # the old composite rows, from the medians
        m = med[v]
        m["chunk ckpt"] = m["chunk ckpt 500K"]
        m["prefill step"] = m["chunk ckpt"] + 4 * m["match miss"]
        m["decode step (short)"] = m["swa evict"]

    print(f"thin core cost (ms, median of {args.repeats} interleaved rounds; one run; cores: "
          + ", ".join(f"{v}={b.core}" for v, b in benches.items()) + ")")
    print(f"{'operation':>20}  {'rust':>9}  {'python':>9}  {'thin':>9}  {'python/rust':>11}  "
          f"{'thin/rust':>9}  {'thin/python':>11}  {'thin_py':>9}  {'thin_py/rust':>12}")
    for op in ("match hit", "match miss", "lock/unlock", "chunk ckpt", "swa evict", "prefill step",
               "decode step (short)"):
        r, p, t, tp = (med[v][op] * 1e3 for v in VARIANTS)
        print(f"{op:>20}  {r:9.3f}  {p:9.3f}  {t:9.3f}  {p / r:11.2f}  {t / r:9.2f}  {t / p:11.2f}  "
              f"{tp:9.3f}  {tp / r:12.2f}")

    print("\nby depth (ms, median; ratios: median of the per-round ratios, min-max in brackets)")
    print(f"{'operation':>20}  {'rust':>8}  {'python':>8}  {'thin':>8}  {'python/rust':>17}  "
          f"{'thin/rust':>17}  {'thin/python':>17}  {'thin_py':>8}  {'thin_py/rust':>17}")
    for depth in DEPTHS:
        for kind in ("chunk ckpt", "decode short"):
            op = f"{kind} {depth}"
            ts = {v: benches[v].times[op] for v in VARIANTS}
            r, p, t, tp = (med[v][op] * 1e3 for v in VARIANTS)
            print(f"{op:>20}  {r:8.3f}  {p:8.3f}  {t:8.3f}  {_ratio_cell(ts['python'], ts['rust']):>17}  "
                  f"{_ratio_cell(ts['thin'], ts['rust']):>17}  {_ratio_cell(ts['thin'], ts['python']):>17}  "
                  f"{tp:8.3f}  {_ratio_cell(ts['thin_py'], ts['rust']):>17}")
    for v in ("thin", "thin_py"):
        times = benches[v].times
        print(f"{v}'s own move (move_passed_checkpoint) per chunk ckpt, median: " + ", ".join(
            f"{d} {statistics.median(times[f'thin move {d}']) * 1e6:.1f} us "
            f"({statistics.median(times[f'thin move {d}']) / med[v][f'chunk ckpt {d}']:.2%} of it)"
            for d in DEPTHS))

    print("\ngoals (issue 25): thin/rust, median of the per-round ratios")
    missed = []
    for op, limit in GOALS:
        ratios = per_round(benches, op)
        got = statistics.median(ratios)
        met = got <= limit
        if not met:
            missed.append(op)
        print(f"  {op:>18} <= {limit:.1f}x: {got:5.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}) "
              f"{'met' if met else 'MISSED'}")
    print("all goals met" if not missed else f"goals missed: {', '.join(missed)}")
    for op in missed:
        profile_op(benches["thin"], op)
    if args.profile:
        profile(benches, EXTRA_STEPS, args.profile)
    from adapter import installer

    installer.reset_for_tests()
    return 0


if __name__ == "__main__":
    sys.exit(main())
