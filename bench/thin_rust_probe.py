"""Does any 0.5.23 eviction setting give thin's order on the Rust tree core? (issue 14 evidence)

On the real cache classes (CPU, adapter/cpu/cpu_engine.build_swa_cache: page 256, window 128),
with no adapter installed (then with thin, for reference): session A (a chunked prompt, decode,
finish) runs, then session B (same shape, other tokens); both go idle. Then the cache is evicted
page by page and the probe prints whose resume point loses its window first (A or B), and how
many of B's passed checkpoints still hold their window then, under every --radix-eviction-policy
(CacheInitParams.eviction_policy, what the launch flag sets) on the rust and the python core,
and for `priority` also with request priorities A=5, B=0 (InsertParams.priority, set from
req.priority at every checkpoint_into_tree: the lower-priority B should go first if priority
were read).
  SWA walk   evict(swa_num_tokens=256) steps; a resume point is lost when any node of its last
             window (window + one page, walking up) has no SWA device value.
  Full walk  on a second, identically built cache: evict(num_tokens=256) steps; lost when the
             session's last node has no Full device value (or left the tree). It shows the
             policy setting does reach each core.
States are read with collect_path_info + get_component_device_value only: a match_prefix would
move the window to MRU and change the order being read. Thin's rule needs "B's passed checkpoints
before A's live point"; stock LRU gives A first, and the SWA column shows whether any setting
changes that.

    .venv/bin/python bench/thin_rust_probe.py
"""
from __future__ import annotations

import logging
import sys
import time
from array import array
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

POLICIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru", "tlru")
CHUNK = 2048
PAGE, WINDOW = 256, 128


def build(core: str, policy: str, priorities: dict | None):
    """A cache with idle sessions A then B; returns (cache, {session: its last node id})."""
    from adapter.cpu import cpu_engine
    from adapter.tools.sims.swa_thin import Driver, Tokens, session

    cpu = cpu_engine.build_swa_cache(full_tokens=PAGE * 400, swa_tokens=PAGE * 48, backend=core,
                                     req_slots=4, max_context_len=PAGE * 200,
                                     chunked_prefill_size=CHUNK, eviction_policy=policy)
    cache = cpu.cache
    if priorities:
        checkpoint = cache.checkpoint_into_tree

        def with_priority(req, *args, **kwargs):
            req.priority = priorities[req.rid.split("#")[0]]   # InsertParams.priority reads it
            return checkpoint(req, *args, **kwargs)

        cache.checkpoint_into_tree = with_priority
    drv = Driver(cpu, concurrency=1, chunk=CHUNK)
    tok = Tokens()
    for name in ("A", "B"):
        drv.run([session(drv, name, tok, array("q"), [2 * CHUNK + 300], 300)])
    last, passed_b = {}, []
    for rid, node, _ in drv.trace:
        name = rid.split("#")[0]
        if name == "B" and name in last:
            passed_b.append(last[name])               # B's checkpoints that B moved past
        last[name] = node
    return cache, last, passed_b


def _path(core, node_id):
    try:
        return core.collect_path_info([node_id])[0]
    except KeyError:
        return None                                   # the node left the tree


def swa_lost(cache, node_id) -> bool:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = cache.tree_core
    path = _path(core, node_id)
    if path is None:
        return True
    covered = 0
    for info in reversed(path):                       # the window: walk up from the end node
        if covered >= WINDOW + PAGE:
            break
        if core.get_component_device_value(info.node_id, ComponentType.SWA) is None:
            return True
        covered += info.path_end - info.path_start
    return False


def full_lost(cache, node_id) -> bool:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    if _path(cache.tree_core, node_id) is None:
        return True
    return cache.tree_core.get_component_device_value(node_id, ComponentType.FULL) is None


def first_lost(cache, last, lost, evict_params, passed=()) -> tuple[str, int]:
    """Evict one page at a time; name the session whose resume point is lost first, and count
    the `passed` checkpoints whose window was still whole at that moment."""
    for _ in range(1000):
        gone = [name for name, node in last.items() if lost(cache, node)]
        if gone:
            return "+".join(gone), sum(not lost(cache, n) for n in passed)
        result = cache.evict(evict_params)
        if not (result.num_tokens_evicted or result.swa_num_tokens_evicted):
            return "none", 0
    return "none", 0


def main() -> int:
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from adapter import installer, receipts

    logging.getLogger("sglang").setLevel(logging.WARNING)
    logging.getLogger(receipts.LOGGER_NAME).setLevel(logging.WARNING)
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    t0 = time.perf_counter()
    rows = []
    # The stock engine (no adapter hooks) under every setting, then thin itself as the reference.
    cases = [({}, policy, priorities, core) for policy in POLICIES
             for priorities in ([None, {"A": 5, "B": 0}] if policy == "priority" else [None])
             for core in ("rust", "python")]
    cases.append(({"DSV41_SWA_THIN": "1"}, "lru", None, "rust"))
    for env, policy, priorities, core in cases:
        installer.install_in_process(env)
        cache, last, passed_b = build(core, policy, priorities)
        kind = type(cache.tree_core).__name__
        swa, whole = first_lost(cache, last, swa_lost, EvictParams(swa_num_tokens=PAGE), passed_b)
        cache, last, _ = build(core, policy, priorities)
        full, _ = first_lost(cache, last, full_lost, EvictParams(num_tokens=PAGE))
        rows.append(("thin" if env else "stock", policy, "A=5 B=0" if priorities else "-",
                     f"{core} -> {kind}", swa, f"{whole}/{len(passed_b)}", full))
    print("whose resume point is lost first (A is older than B; thin's order: B's passed "
          "checkpoints go before A's live point)")
    print(f"{'engine':>6}  {'policy':>8}  {'priority':>8}  {'core':<30}  {'SWA walk':>8}  "
          f"{'B passed whole':>14}  {'Full walk':>9}")
    for engine, policy, prio, core, swa, whole, full in rows:
        print(f"{engine:>6}  {policy:>8}  {prio:>8}  {core:<30}  {swa:>8}  {whole:>14}  {full:>9}")
    stock = [r for r in rows if r[0] == "stock"]
    print(f"\nstock, SWA walk: A first and B's passed checkpoints still whole under every setting, "
          f"both cores: {all(r[4] == 'A' and not r[5].startswith('0/') for r in stock)}; "
          f"Full walk follows the policy (B first under some): {any(r[6] == 'B' for r in stock)}; "
          f"thin: B's passed checkpoints gone first: {rows[-1][5].startswith('0/')}  "
          f"({time.perf_counter() - t0:.1f} s)")
    installer.reset_for_tests()
    return 0


if __name__ == "__main__":
    sys.exit(main())
