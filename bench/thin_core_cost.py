"""What thin's Python tree core costs in scheduler time, vs the engine-default Rust core.

One run, three caches with the same realistic tree, built by the same requests through the
engine's own entry points (adapter/tools/sims/swa_thin.py Driver): two idle sessions (330K / 300K
tokens, 8192-token chunks + agent turns), two 500K sessions and 40 sub-agents x 3 turns on a
shared system prompt, on the 384-tail pool (182,784 SWA slots, 3,444,224 full tokens).
  rust   : engine default, no adapter
  python : the Python core, no adapter (what thin selects)
  thin   : DSV41_SWA_THIN=1 (Python core + the reorder hook)
Then the cache operations a scheduler step runs are timed on each (median of repeats, CPU wall
time of this machine; no GPU work is involved in any of them):
  match hit   match_prefix of a 500K session's context + a new turn (admission / waiting queue)
  match miss  match_prefix of an 8K prompt sharing only the system prompt
  chunk ckpt  checkpoint_kv_cache of one 8192-token chunk of a request at depth ~500K
              (insert + re-lock + thin's move), incl. its evict_for_alloc + slot allocation
  swa evict   evict(swa_num_tokens=512) on a tree full of passed checkpoints
  lock/unlock lock + unlock of the 500K session's node
Per step: a prefill step = 1 chunk ckpt + 4 match (waiting queue); a decode step touches the
tree only when allocation is short (1 swa evict). Printed: per-op times and python/rust,
thin/rust ratios, measured in this one run.

    .venv/bin/python bench/thin_core_cost.py [--repeats N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def build(variant: str):
    from adapter import installer
    from adapter.cpu import cpu_engine
    from adapter.tools.sims import swa_thin as sim

    env = {"DSV41_SWA_THIN": "1"} if variant == "thin" else {}
    installer.install_in_process(env)

    cpu = cpu_engine.build_swa_cache(full_tokens=3_444_224, swa_tokens=sim.swa_slots(384),
                                     backend="python" if variant == "python" else "rust",
                                     req_slots=8, max_context_len=600_000, chunked_prefill_size=8192)
    drv = sim.Driver(cpu, concurrency=4)
    tok = sim.Tokens()
    ctxs = {}
    jobs = []
    for name, first, turns in (("idle0", 200_000, 17), ("idle1", 200_000, 13),
                               ("big0", 500_000, 0), ("big1", 500_000, 0)):
        ctxs[name] = array("q")
        jobs.append(sim.session(drv, name, tok, ctxs[name], [first] + [6000] * turns, 768))
    drv.run(jobs)
    system = tok.fresh(12_288)
    drv.run([sim.session(drv, f"sub{j}", tok, array("q", system), [6000] * 3, 768) for j in range(40)])
    return cpu, drv, tok, ctxs, system


def median_time(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def measure(variant: str, repeats: int) -> dict:
    from adapter import installer
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cpu, drv, tok, ctxs, system = build(variant)
    cache = cpu.cache
    hit_key = RadixKey(ctxs["big0"] + tok.fresh(2000))
    miss_key = RadixKey(system + tok.fresh(8192))
    res = {"core": type(cache.tree_core).__name__}
    res["match hit"] = median_time(lambda: cache.match_prefix(MatchPrefixParams(key=hit_key)), repeats)
    res["match miss"] = median_time(lambda: cache.match_prefix(MatchPrefixParams(key=miss_key)), repeats)
    node = cache.match_prefix(MatchPrefixParams(key=hit_key)).last_device_node

    def lock_unlock():
        cache.unlock(cache.lock(node))

    res["lock/unlock"] = median_time(lock_unlock, repeats)

    # Chunk checkpoints at depth ~500K: a new turn on big1 with `repeats` chunks; time each yield
    # step of the Driver that ends in checkpoint_kv_cache (alloc + evict_for_alloc + checkpoint).
    prompt = ctxs["big1"] + tok.fresh(8192 * repeats)
    gen = drv.turn("deep", prompt, array("q"))
    steps = []
    while True:
        t = time.perf_counter()
        try:
            next(gen)
        except StopIteration:
            break
        steps.append(time.perf_counter() - t)
    res["chunk ckpt"] = statistics.median(steps[1:]) if len(steps) > 1 else steps[0]

    def swa_evict():
        cache.evict(EvictParams(swa_num_tokens=512))

    res["swa evict"] = median_time(swa_evict, repeats)
    cache.sanity_check()
    res["prefill step"] = res["chunk ckpt"] + 4 * res["match miss"]
    res["decode step (short)"] = res["swa evict"]
    installer.reset_for_tests()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    import logging
    logging.getLogger("sglang").setLevel(logging.WARNING)

    results = {v: measure(v, args.repeats) for v in ("rust", "python", "thin")}
    ops = [k for k in results["rust"] if k != "core"]
    print(f"thin core cost (ms, median of {args.repeats}; one run; cores: "
          + ", ".join(f"{v}={r['core']}" for v, r in results.items()) + ")")
    print(f"{'operation':>20}  {'rust':>9}  {'python':>9}  {'thin':>9}  {'python/rust':>11}  {'thin/rust':>9}")
    for op in ops:
        r, p, t = (results[v][op] * 1e3 for v in ("rust", "python", "thin"))
        print(f"{op:>20}  {r:9.3f}  {p:9.3f}  {t:9.3f}  {p / r:11.2f}  {t / r:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
