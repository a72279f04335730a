"""Thin's own tree core (adapter/swa_thin/core.py) against the engine's Python core, on the real
UnifiedRadixCache (FULL + SWA, page 256, window 128) with the real ReqToTokenPool / SWAKVPool /
SWATokenToKVPoolAllocator, driven by real `Req`s through the engine's own entry points
(adapter/tools/sims/swa_thin.py Driver: match, PrefillAdder admission and lock, chunked prefill
with evict + allocation + checkpoint per chunk, decode blocks with evict_sliding_windows,
release), plus bare matches, lock / unlock and evictions.

Two caches run every random sequence in lockstep and are compared after every operation:
the same tree (keys, Full and SWA values, lock refs), the same SWA LRU order, the same evictable
leaf sets, evictable / protected sizes and allocator free counts, the same relative access order,
the same match / evict / turn results; `sanity_check()` holds on both.
- thin on (DSV41_SWA_THIN=1): thin's core, moved through its `demote_swa_lru`, against the
  engine's Python core with thin's order (relinked through `UnifiedLRUList`, swa_thin.OWN_CORE
  off): the order thin produces is the same on both.
- thin off: thin's core against the engine's Python core, no adapter: it evicts exactly as the
  engine does.
Deterministic (hypothesis derandomized, bounded examples)."""
from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapter.tools.sims.swa_thin import Driver, Tokens

PAGE = 256
CHUNK = 1024
FULL_PAGES, SWA_PAGES = 200, 24        # small pools: turns evict Full and SWA as they allocate
MAX_LIVE, MAX_LOCKS, MAX_CONTEXT = 3, 3, 40 * PAGE
THIN = {"DSV41_SWA_THIN": "1"}

OPS = st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 4), st.integers(0, 9), st.integers(0, 255),
              st.integers(0, 400), st.booleans()),
    st.tuples(st.just("step"), st.integers(0, 5), st.integers(1, 12)),
    st.tuples(st.just("step"), st.integers(0, 5), st.integers(1, 12)),
    st.tuples(st.just("match"), st.integers(0, 4), st.floats(0, 1)),
    st.tuples(st.just("evict"), st.integers(0, 8), st.integers(0, 8)),
    st.tuples(st.just("lock"), st.integers(0, 4), st.floats(0, 1)),
    st.tuples(st.just("unlock"), st.integers(0, 5)),
)
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Side:
    """One cache and the requests, contexts and locks a sequence builds on it."""

    def __init__(self, backend: str):
        from adapter.cpu import cpu_engine

        self.cpu = cpu_engine.build_swa_cache(full_tokens=FULL_PAGES * PAGE, swa_tokens=SWA_PAGES * PAGE,
                                              backend=backend, req_slots=MAX_LIVE + 2,
                                              max_context_len=MAX_CONTEXT + 16 * PAGE,
                                              chunked_prefill_size=CHUNK)
        self.cache = self.cpu.cache
        self.drv = Driver(self.cpu, concurrency=MAX_LIVE, chunk=CHUNK)
        self.tok = Tokens()
        self.contexts = [array("q") for _ in range(5)]
        self.live, self.locks = [], []

    def _job(self, conv, prompt, out, fork):
        yield from self.drv.turn(f"c{conv}", prompt, out)
        if not fork:
            self.contexts[conv] = prompt + out

    def _prefix(self, conv, frac):
        ctx = self.contexts[conv]
        return ctx[: int(len(ctx) * frac)] + array("q", [3])

    def apply(self, op):
        """Run `op`; returns what it answered (node ids as Python objects, canonicalized later)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        cache, kind = self.cache, op[0]
        if kind == "turn" and len(self.live) < MAX_LIVE:
            _, conv, pages, partial, out_len, fork = op
            base = self.contexts[conv]
            if fork and len(base):
                base = base[: len(base) // 2]
            if len(base) + pages * PAGE + partial + out_len > MAX_CONTEXT:
                base = array("q")
            prompt = base + self.tok.fresh(pages * PAGE + partial + 1)
            self.live.append(self._job(conv, prompt, self.tok.fresh(out_len), fork))
            next(self.live[-1])
            return ("turn", len(self.drv.results))
        if kind == "step" and self.live:
            _, k, n = op
            gen = self.live[k % len(self.live)]
            for _ in range(n):
                try:
                    next(gen)
                except StopIteration:
                    self.live.remove(gen)
                    break
            return ("step", len(self.drv.trace))
        if kind == "match":
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(self._prefix(op[1], op[2]))))
            return ("match", m.device_prefix_len, self._node(m.last_device_node))
        if kind == "evict":
            r = cache.evict(EvictParams(num_tokens=op[1] * PAGE, swa_num_tokens=op[2] * PAGE))
            return ("evict", r.num_tokens_evicted, r.swa_num_tokens_evicted)
        if kind == "lock" and len(self.locks) < MAX_LOCKS:
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(self._prefix(op[1], op[2]))))
            self.locks.append(cache.lock(m.last_device_node))
            return ("lock", m.device_prefix_len, self._node(m.last_device_node))
        if kind == "unlock" and self.locks:
            cache.unlock(self.locks.pop(op[1] % len(self.locks)))
            return ("unlock",)
        return ("skip",)

    def _node(self, node_id):
        return self.cache.tree_core.node_by_id(node_id)

    def finish_op(self):
        """The next step of draining: every live turn to its end, then every lock released."""
        if self.live:
            return self.apply(("step", 0, 1))
        if self.locks:
            return self.apply(("unlock", 0))
        return None


def _values(v):
    return None if v is None else tuple(v) if isinstance(v, list) else bytes(v.numpy())


def snapshot(side: Side, answer=None):
    """Everything the two cores must agree on, with nodes named by their place in the tree."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    FULL, SWA = ComponentType.FULL, ComponentType.SWA
    core, alloc = side.cache.tree_core, side.cpu.allocator
    index, nodes, stack = {}, [], [(core.root_node, -1)]
    while stack:                                  # DFS, children by their first page
        node, parent = stack.pop()
        index[id(node)] = len(nodes)
        full, swa = node.component_data[FULL], node.component_data[SWA]
        nodes.append((parent, node.key.token_ids.tobytes(), _values(full.value), _values(swa.value),
                      full.lock_ref, swa.lock_ref, node.priority, node.hit_count))
        kids = sorted(node.children.values(), key=lambda c: c.key.token_ids[:PAGE].tobytes(), reverse=True)
        stack.extend((c, index[id(node)]) for c in kids)
    all_nodes = core._collect_all_nodes()
    assert len(all_nodes) == len(nodes)
    lru = core.lru_lists[SWA]
    order, x = [], lru.head.lru_next[lru._pt]
    while x is not lru.tail:
        if x is not lru.mid and x is not lru.cursor:
            order.append(index[id(x)])
        x = x.lru_next[lru._pt]
    recency = [index[id(n)] for n in sorted(all_nodes, key=lambda n: n.last_access_time)]

    def name(v):
        return index.get(id(v), "gone") if hasattr(v, "component_data") else v

    return {
        "answer": None if answer is None else tuple(name(v) for v in answer),
        "nodes": nodes, "swa_lru": order, "recency": recency,
        "device_leaves": sorted(index[id(n)] for n in core.evictable_device_leaves),
        "host_leaves": sorted(index[id(n)] for n in core.evictable_host_leaves),
        "sizes": [(core.component_evictable_size(ct), core.component_protected_size(ct)) for ct in (FULL, SWA)],
        "free": (alloc.full_available_size(), alloc.swa_available_size()),
        "turns": [(r.name, r.prompt_len, r.cached, r.prefix, r.prefill, r.waits) for r in side.drv.results],
        "checkpoints": [(rid, up_to) for rid, _, up_to in side.drv.trace],
    }


def run_lockstep(ops, make_a, make_b):
    a, b = make_a(), make_b()
    for op in ops:
        answer_a, answer_b = a.apply(op), b.apply(op)
        a.cache.sanity_check()
        b.cache.sanity_check()
        assert snapshot(a, answer_a) == snapshot(b, answer_b), op
    while True:                                   # drain in lockstep too
        answer_a, answer_b = a.finish_op(), b.finish_op()
        a.cache.sanity_check()
        b.cache.sanity_check()
        assert snapshot(a, answer_a) == snapshot(b, answer_b), "drain"
        if answer_a is None:
            break
    for side in (a, b):                           # nothing protected, nothing leaked
        assert side.cache.full_protected_size() == 0 and side.cache.swa_protected_size() == 0
    return a, b


def _thin_side(backend="rust"):
    side = Side(backend)
    assert type(side.cache.tree_core).__name__ == "ThinTreeCore"
    return side


@pytest.mark.parametrize("scan_max", [16, 1], ids=["page-compare", "dict-lookup"])
def test_thin_core_with_thins_order_equals_python_core_with_thins_order(install_adapters, monkeypatch,
                                                                       scan_max):
    from adapter import swa_thin
    from adapter.swa_thin import core as thin_core

    assert install_adapters(THIN)["swa_thin"].status == "installed"
    monkeypatch.setattr(thin_core, "SCAN_MAX", scan_max)   # 1: nodes with 2+ children use the dict
    swa_thin.reset_counts()

    def engine_side():
        monkeypatch.setattr(swa_thin, "OWN_CORE", False)
        try:
            side = Side("rust")                   # thin switches rust to the engine's Python core
        finally:
            monkeypatch.setattr(swa_thin, "OWN_CORE", True)
        assert type(side.cache.tree_core).__name__ == "UnifiedTreeCore"
        return side

    @SETTINGS
    @given(st.lists(OPS, min_size=10, max_size=40))
    def prop(ops):
        run_lockstep(ops, _thin_side, engine_side)

    prop()
    s = swa_thin.summary()
    assert s["nodes_moved"] > 0 and s["core"]["dsv41_thin"] > 0 and s["core"]["python"] > 0


def test_thin_core_without_thin_evicts_as_the_python_core(install_adapters):
    from adapter import swa_thin

    assert install_adapters({})["swa_thin"].status == "off"
    swa_thin._register_core()             # the core alone, no hook: the engine's own order

    @SETTINGS
    @given(st.lists(OPS, min_size=10, max_size=40))
    def prop(ops):
        run_lockstep(ops, lambda: _thin_side("dsv41_thin"), lambda: Side("python"))

    prop()


def test_a_scripted_run_moves_through_the_binding_and_matches(install_adapters, monkeypatch):
    """One fixed sequence that passes checkpoints, evicts SWA and resumes: both cores agree and
    the move went through thin's core's binding (not the Python-LRU relink)."""
    from adapter import swa_thin
    from adapter.swa_thin.core import ThinTreeCore

    install_adapters(THIN)
    calls = []
    real = ThinTreeCore.demote_swa_lru
    monkeypatch.setattr(ThinTreeCore, "demote_swa_lru",
                        lambda self, ids: calls.append(list(ids)) or real(self, ids))
    ops = [("turn", 0, 9, 10, 300, False), ("step", 0, 12), ("turn", 1, 9, 10, 300, False),
           ("step", 0, 12), ("turn", 2, 6, 0, 100, False), ("step", 0, 12), ("evict", 0, 8),
           ("match", 0, 1.0), ("evict", 4, 8), ("lock", 1, 1.0), ("turn", 0, 2, 5, 40, False),
           ("step", 0, 12), ("unlock", 0), ("evict", 8, 8), ("match", 0, 1.0), ("match", 1, 1.0)]

    def engine_side():
        monkeypatch.setattr(swa_thin, "OWN_CORE", False)
        try:
            return Side("rust")
        finally:
            monkeypatch.setattr(swa_thin, "OWN_CORE", True)

    run_lockstep(ops, _thin_side, engine_side)
    assert calls and all(calls)


# ---- the day a core exposes the binding: thin keeps that core and moves through it -----------

class _PathInfo:
    def __init__(self, node_id, parent_id, start, end):
        self.node_id, self.parent_id, self.path_start, self.path_end = node_id, parent_id, start, end


class StandInCore:
    """A core object with no Python nodes, only the binding and what every core has: a chain
    root(0) -> 1 -> 2 -> ... of 256-token nodes; `swa` says which nodes still hold SWA."""

    page_size = PAGE

    def __init__(self, depth, swa, outcomes):
        self.depth, self.swa, self.outcomes, self.calls = depth, swa, outcomes, []

    def collect_path_info(self, node_ids):
        (node_id,) = node_ids
        if not 0 <= node_id <= self.depth:
            raise KeyError(node_id)
        return (tuple(_PathInfo(i, i - 1, (i - 1) * PAGE, i * PAGE) for i in range(1, node_id + 1)),)

    def get_component_device_value(self, node_id, component_type):
        return [node_id] if node_id in self.swa else None

    def is_root(self, node_id):
        return node_id == 0

    def demote_swa_lru(self, node_ids):
        self.calls.append(list(node_ids))
        return [self.outcomes.get(i, "moved") for i in node_ids]


def test_selection_keeps_a_core_that_exposes_the_binding(install_adapters, monkeypatch, caplog):
    import logging

    from adapter import receipts, swa_thin
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache import tree_core_registry
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    assert install_adapters(THIN)["swa_thin"].status == "installed"
    swa_thin.reset_counts()

    class RustWithBinding:                 # the engine's Rust core class, one engine pin later
        def demote_swa_lru(self, node_ids):
            return []

    real = swa_thin._engine_core_class
    monkeypatch.setattr(swa_thin, "_engine_core_class",
                        lambda name: RustWithBinding if name == "rust" else real(name))

    def select(backend):
        return tree_core_registry.select_tree_core_backend(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=PAGE,
            tree_components=(ComponentType.FULL, ComponentType.SWA), tree_core_backend=backend))

    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        assert select("rust") == "rust"            # exposes it: kept
        assert select("python") == "dsv41_thin"   # the engine's Python core does not
    assert receipts.counters["swa_thin"]["core:rust"] == 1
    assert receipts.counters["swa_thin"]["core:dsv41_thin"] == 1
    assert any("tree core: rust kept (it exposes demote_swa_lru" in r.getMessage() for r in caplog.records)
    # Today's engine: neither of its cores exposes the binding.
    assert not hasattr(real("python"), "demote_swa_lru")
    assert not hasattr(real("rust"), "demote_swa_lru")


def test_the_move_goes_through_a_cores_binding(monkeypatch):
    """On a core with the binding and no Python nodes (the window read from collect_path_info):
    one call with the passed window deepest first, minus the new window; outcomes counted as
    thin counts them (moved; kept by reason; tombstones not counted)."""
    import types

    from adapter import swa_thin
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    swa_thin.reset_counts()
    # Window = 128 + 256 tokens = two 256-token nodes. Old checkpoint at node 6 (window 6, 5),
    # the request moved to node 7 (window 7, 6): 6 is in the new window, 5 is passed.
    core = StandInCore(depth=8, swa={5, 6, 7}, outcomes={})
    cache = types.SimpleNamespace(tree_core=core, disable=False, is_swa_enabled=True,
                                  components={ComponentType.SWA: types.SimpleNamespace(sliding_window_size=128)})
    assert swa_thin.move_passed_checkpoint(cache, 6, 7) == (1, 1)
    assert core.calls == [[5]]
    # A checkpoint passed by a long way (old 3, new 8): both old window nodes go to the binding,
    # deepest first; one locked, one a tombstone by then.
    core = StandInCore(depth=8, swa={7, 8}, outcomes={3: "locked", 2: "tombstone"})
    cache.tree_core = core
    assert swa_thin.move_passed_checkpoint(cache, 3, 8) == (0, 1)
    assert core.calls == [[3, 2]]
    s = swa_thin.summary()
    assert s["nodes_moved"] == 0          # counted by the hook, not by the move
    assert s["kept"] == {"in-new-window": 1, "locked": 1}
    # A node that left the tree: the fallback, order unchanged.
    assert swa_thin.move_passed_checkpoint(cache, 3, 99) == (0, 0)
    assert core.calls == [[3, 2]]


@pytest.mark.parametrize("page", [1, 4])
def test_limited_and_short_keys_match_as_the_python_core(install_adapters, page):
    """Page 1 keeps a match key's `limit` (page_aligned returns the key itself): thin's walks read
    below it exactly as the engine's; every prefix length and limit, on two shared-prefix chains."""
    from adapter import swa_thin
    from adapter.cpu import cpu_engine
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    install_adapters({})
    swa_thin._register_core()

    def build(backend):
        cpu = cpu_engine.build_swa_cache(full_tokens=page * 512, swa_tokens=page * 256, page_size=page,
                                         window=4 * page, backend=backend, req_slots=4,
                                         max_context_len=page * 256)
        cache = cpu.cache
        base = list(range(100, 100 + 24 * page))
        for seq in (base, base[: 8 * page] + list(range(900, 900 + 12 * page)), base + [7] * (4 * page)):
            value = cpu.alloc(len(seq))
            cache.insert(InsertParams(key=RadixKey(array("q", seq)), value=value))
        return cache, base

    (thin, base), (engine, _) = build("dsv41_thin"), build("python")
    assert type(thin.tree_core).__name__ == "ThinTreeCore"
    for n in range(0, len(base) + 4 * page + 1, max(1, page // 2)):
        for limit in (None, n // 2, max(0, n - 1), n + 3):
            seq = (base + [7] * (4 * page))[:n] + [5]
            got = [c.match_prefix(MatchPrefixParams(key=RadixKey(array("q", seq), limit=limit)))
                   for c in (thin, engine)]
            assert got[0].device_prefix_len == got[1].device_prefix_len, (n, limit)
            assert _path(thin, got[0].last_device_node) == _path(engine, got[1].last_device_node)
    assert _tree(thin) == _tree(engine)            # the same splits on the way
    thin.sanity_check()
    engine.sanity_check()


def _path(cache, node_id):
    core = cache.tree_core
    node, out = core.node_by_id(node_id), []
    while node is not core.root_node:
        out.append(node.key.token_ids.tobytes())
        node = node.parent
    return out


def _tree(cache):
    out, stack = [], [(cache.tree_core.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        out.append((depth, node.key.token_ids.tobytes()))
        stack.extend((c, depth + 1) for c in sorted(node.children.values(),
                                                      key=lambda c: c.key.token_ids.tobytes()))
    return out
