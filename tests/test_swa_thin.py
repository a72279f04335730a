"""swa_thin on the real UnifiedRadixCache (FULL + SWA, page 256, window 128 as DSV4) with the real
ReqToTokenPool / SWAKVPool / SWATokenToKVPoolAllocator on CPU, driven by real `Req`s through the
engine's own cache entry points (adapter/tools/sims/swa_thin.py Driver)."""
from __future__ import annotations

import logging
from array import array

import pytest

from adapter.tools.sims.swa_thin import Driver, Tokens, session

THIN = {"DSV41_SWA_THIN": "1"}
CHUNK = 2048          # small chunks keep the tests fast; the rule does not depend on the size


def _build(backend="python", full_pages=400, swa_pages=48, slots=6):
    from adapter.cpu import cpu_engine

    return cpu_engine.build_swa_cache(full_tokens=256 * full_pages, swa_tokens=256 * swa_pages,
                                      backend=backend, req_slots=slots, max_context_len=256 * 200,
                                      chunked_prefill_size=CHUNK)


def _swa_lru(cache):
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return cache.tree_core.lru_lists[ComponentType.SWA]


def _has_swa(cache, node_id) -> bool:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    try:
        node = cache.tree_core.node_by_id(node_id)
    except KeyError:
        return False      # an evicted leaf is deleted outright
    return node.component_data[ComponentType.SWA].value is not None


def _window(cache, node_id, span=128 + 256):
    """Node ids of the checkpoint window ending at node_id, defined by token positions, not by
    thin's own walk: the nodes on the root path whose tokens reach into the last `span` tokens of
    that path (by default the window + one page: the span the engine refreshes at MATCH_END /
    INSERT_END, SWAComponent.refresh_lru, sliding_window_size + page_size)."""
    core = cache.tree_core
    path, node = [], core.node_by_id(node_id)
    while node is not None and not core.is_root(node.id):
        path.append(node)
        node = node.parent
    path.reverse()                                   # root .. node
    end = sum(len(n.key) for n in path)
    start, pos, out = end - span, 0, []
    for n in path:
        pos += len(n.key)                            # n covers [pos - len, pos)
        if pos > start:
            out.append(n.id)
    return out[::-1]                                 # deepest first


def _two_sessions(cpu):
    """Session S (chunked prompt, decode, finish) then traffic T (same shape, other tokens)."""
    drv = Driver(cpu, concurrency=1, chunk=CHUNK)
    tok = Tokens()
    s_ctx, t_ctx = array("q"), array("q")
    drv.run([session(drv, "S", tok, s_ctx, [4 * CHUNK + 300], 300)])
    drv.run([session(drv, "T", tok, t_ctx, [4 * CHUNK + 300], 300)])
    by_req = {}
    for rid, node, _ in drv.trace:
        by_req.setdefault(rid.split("#")[0], []).append(node)
    return drv, s_ctx, by_req


def _evict_until_resume_point_lost(cpu, live_node):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    evicted = 0
    while all(_has_swa(cpu.cache, n) for n in _window(cpu.cache, live_node)):
        r = cpu.cache.evict(EvictParams(swa_num_tokens=256))
        assert r.swa_num_tokens_evicted > 0, "nothing left to evict"
        evicted += r.swa_num_tokens_evicted
        cpu.cache.sanity_check()
    return evicted


@pytest.mark.parametrize("requested", ["rust", "python"])
def test_installs_and_selects_its_own_core(install_adapters, requested):
    status = install_adapters(THIN)
    assert status["swa_thin"].status == "installed", status["swa_thin"].detail
    assert status["swa_thin"].pin_ok
    # The production launch asks for the engine default (rust); a FULL+SWA cache gets thin's
    # own core (a subclass of the engine's Python core, registered with the engine).
    cpu = _build(backend=requested)
    from adapter.swa_thin.core import ThinTreeCore
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    assert type(cpu.cache.tree_core) is ThinTreeCore and isinstance(cpu.cache.tree_core, UnifiedTreeCore)


def test_key_unset_leaves_the_engine_default_core(install_adapters):
    status = install_adapters({})
    assert status["swa_thin"].status == "off"
    cpu = _build(backend="rust")
    assert type(cpu.cache.tree_core).__name__ == "RustUnifiedTreeCore"


@pytest.mark.parametrize("requested", ["python", "rust"])
def test_moved_past_checkpoints_are_evicted_before_the_live_resume_point(install_adapters, requested):
    install_adapters(THIN)
    cpu = _build(backend=requested)
    drv, s_ctx, nodes = _two_sessions(cpu)
    live_s = nodes["S"][-1]
    passed = [n for name in ("S", "T") for n in nodes[name][:-1]]
    assert len(passed) == 2 * 5           # 4 chunk boundaries + the prompt end, per request
    passed_nodes = _passed_window_nodes(cpu, nodes, ("S", "T"))
    assert len(passed_nodes) >= 2 * 8
    _evict_until_resume_point_lost(cpu, live_s)
    # By the time S's live resume point loses its window, every passed checkpoint already had.
    assert [n for n in passed_nodes if _has_swa(cpu.cache, n)] == []


def _passed_window_nodes(cpu, nodes, names):
    """SWA nodes of the passed checkpoints of `names`, minus those of any live resume window
    (a prompt-end checkpoint shares nodes with the window of the turn's end, a short step away)."""
    live = {m for name in nodes for m in _window(cpu.cache, nodes[name][-1])}
    passed = {m for name in names for n in nodes[name][:-1] for m in _window(cpu.cache, n)}
    return sorted(m for m in passed - live if _has_swa(cpu.cache, m))


def test_without_thin_the_older_live_point_goes_first(install_adapters):
    """Control on the same sequence: S's live point is older than T's passed checkpoints, so the
    engine's LRU evicts it while T's passed checkpoints still hold SWA (what thin changes)."""
    install_adapters({})
    cpu = _build(backend="python")
    drv, s_ctx, nodes = _two_sessions(cpu)
    passed_t = _passed_window_nodes(cpu, nodes, ("T",))
    assert passed_t
    _evict_until_resume_point_lost(cpu, nodes["S"][-1])
    still = [n for n in passed_t if _has_swa(cpu.cache, n)]
    assert still == passed_t, "the engine evicts S's older live point before T's passed checkpoints"


def test_resume_after_traffic(install_adapters):
    """End to end on match lengths, both runs on the engine-default request (rust): evict as much
    SWA as the passed checkpoints hold; under thin S then resumes with its whole context."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    def resume(cpu, s_ctx):
        m = cpu.cache.match_prefix(MatchPrefixParams(key=RadixKey(s_ctx + array("q", [7]))))
        return m.device_prefix_len

    install_adapters(THIN)
    cpu = _build(backend="rust")
    _, s_ctx, nodes = _two_sessions(cpu)
    core = cpu.cache.tree_core
    budget = sum(len(core.node_by_id(m).component_data[ComponentType.SWA].value)
                 for m in _passed_window_nodes(cpu, nodes, ("S", "T")))
    assert budget >= 16 * 256
    cpu.cache.evict(EvictParams(swa_num_tokens=budget))
    cpu.cache.sanity_check()
    assert resume(cpu, s_ctx) == len(s_ctx) // 256 * 256

    install_adapters({})
    cpu = _build(backend="rust")
    _, s_ctx, _ = _two_sessions(cpu)
    cpu.cache.evict(EvictParams(swa_num_tokens=budget))
    cpu.cache.sanity_check()
    assert resume(cpu, s_ctx) < len(s_ctx) // 2


def _eviction_order(cpu):
    """Evict SWA page by page; the sequence of (first token, length) of the nodes that lost SWA."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    lru = _swa_lru(cpu.cache)
    order = []
    while lru.cache:
        before = {i: (n.key.token_ids[0], len(n.key)) for i, n in lru.cache.items()}
        cpu.cache.evict(EvictParams(swa_num_tokens=256))
        gone = sorted(v for i, v in before.items() if i not in lru.cache)
        assert gone, "evict made no progress"
        order.append(tuple(gone))
    return order


def _scripted_order():
    cpu = _build(backend="python")
    _two_sessions(cpu)
    return _eviction_order(cpu)


def test_key_unset_keeps_the_engines_own_order(install_adapters):
    from adapter import installer

    installer.reset_for_tests()          # the engine exactly as shipped: nothing installed
    stock = _scripted_order()
    install_adapters({})                 # key unset through the production installer
    unset = _scripted_order()
    install_adapters(THIN)
    thin = _scripted_order()
    assert unset == stock
    assert thin != stock                 # the same script under thin evicts in another order
    assert sorted(thin) == sorted(stock) # ... of the same nodes: only the order differs


def test_receipt_line_every_1024_inserts(install_adapters, caplog, monkeypatch):
    from adapter import swa_thin

    install_adapters(THIN)
    monkeypatch.setattr(swa_thin, "RECEIPT_EVERY", 4)
    swa_thin.reset_counts()
    cpu = _build()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        _two_sessions(cpu)
    lines = [r.getMessage() for r in caplog.records if "hooked inserts" in r.getMessage()]
    counts = swa_thin.summary()
    assert len(lines) == counts["hooked_inserts"] // 4 == 3
    # at the 4th, 8th and 12th insert (not the 1st, 5th, 9th)
    assert [ln.split(" hooked inserts")[0].rsplit(" ", 1)[1] for ln in lines] == ["4", "8", "12"]
    assert "moved to the evict-first end" in lines[0] and "kept" in lines[0]
    assert counts["checkpoints_passed"] == 10 and counts["nodes_moved"] > 0


def test_counters_live_in_the_receipts_counter_source(install_adapters):
    """The names another exporter reads: receipts.counters["swa_thin"] holds every count thin
    keeps (hooked_inserts, checkpoints_passed, nodes_moved, kept:<reason>, core:<name>)."""
    from adapter import receipts, swa_thin

    install_adapters(THIN)
    swa_thin.reset_counts()
    cpu = _build(backend="rust")                  # switched: served by the Python core
    _two_sessions(cpu)
    _build(backend="python")                      # asked for python: switched too
    c = receipts.counters["swa_thin"]
    assert c["core:dsv41_thin"] == 2 and c["core:python"] == 0 and c["core:rust"] == 0
    assert c["hooked_inserts"] == 12 and c["checkpoints_passed"] == 10   # 2 x (5 chunks + final)
    assert c["nodes_moved"] > 0
    kept = {k: v for k, v in c.items() if k.startswith("kept:")}
    assert set(kept) <= {"kept:in-new-window", "kept:locked", "kept:session"} and kept
    assert "python_core_selected" not in c
    summary = swa_thin.summary()
    assert summary["nodes_moved"] == c["nodes_moved"] and summary["core"] == {"dsv41_thin": 2}
    assert summary["kept"] == {k[len("kept:"):]: v for k, v in kept.items()}


def test_only_list_order_changes(install_adapters, monkeypatch):
    """Around every move: same nodes, sizes, lock refs, values; the moved nodes end at the tail."""
    from adapter import swa_thin

    install_adapters(THIN)
    real = swa_thin.move_passed_checkpoint
    seen = []

    def spy(cache, old_id, new_id):
        window = set(_window(cache, old_id))
        before = _snapshot(cache)
        moved, kept = real(cache, old_id, new_id)
        after = _snapshot(cache)
        assert before[0] == after[0]           # nodes, values, lock refs, sizes, LRU membership
        if moved:
            tail = after[1][-moved:]
            assert set(tail) <= window         # the passed checkpoint's nodes, at the tail ...
            assert [x for x in before[1] if x not in tail] == after[1][:-moved]  # ... rest as before
        else:
            assert before[1] == after[1]
        seen.append(moved)
        return moved, kept

    monkeypatch.setattr(swa_thin, "move_passed_checkpoint", spy)
    cpu = _build()
    _two_sessions(cpu)
    assert sum(seen) > 0


def _snapshot(cache):
    """(state that thin must not change, SWA LRU order MRU..LRU)."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = cache.tree_core
    nodes = []
    for node in core._collect_all_nodes():
        cds = tuple((ct, cd.lock_ref, None if cd.value is None else [int(v) for v in cd.value])
                    for ct, cd in enumerate(node.component_data) if cd is not None)
        nodes.append((node.id, None if node.parent is None else node.parent.id, len(node.key), cds))
    sizes = tuple((ct, core.component_evictable_size(ct), core.component_protected_size(ct))
                  for ct in (ComponentType.FULL, ComponentType.SWA))
    lru = _swa_lru(cache)
    order, x = [], lru.head.lru_next[lru._pt]
    while x is not lru.tail:
        if x.id in lru.cache:
            order.append(x.id)
        x = x.lru_next[lru._pt]
    return (sorted(nodes), sizes, sorted(lru.cache)), order


def test_production_path_in_a_child():
    """sitecustomize arms the installer from the environment, as in the image: a cache the
    engine would build on the Rust core gets thin's core and thin's receipt lines."""
    from conftest import run_python

    code = ("from adapter.cpu import cpu_engine\n"
            "cpu = cpu_engine.build_swa_cache(full_tokens=256 * 64, swa_tokens=256 * 16, backend='rust')\n"
            "print('CORE', type(cpu.cache.tree_core).__name__)\n")
    on = run_python(code, env=THIN)
    assert on.returncode == 0, on.stderr[-2000:]
    assert "CORE ThinTreeCore" in on.stdout
    assert "swa_thin installed" in on.stderr and "tree core: dsv41_thin instead of rust" in on.stderr
    # (key unset: test_key_unset_leaves_the_engine_default_core, in process)


def test_dense_cache_keeps_the_rust_core_with_a_fallback_line(install_adapters, caplog):
    """Issue 16's audit: a cache with no SWA component has no SWA LRU to reorder, so thin leaves
    the engine's Rust selection alone (one fallback line) instead of paying for the Python core."""
    import logging

    from adapter import receipts
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache import tree_core_registry
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    receipts.forget("swa_thin")
    assert install_adapters(THIN)["swa_thin"].status == "installed"

    def params(components):
        return CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=None,
                               page_size=1, tree_components=components, tree_core_backend="rust")

    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        dense = tree_core_registry.select_tree_core_backend(params((ComponentType.FULL,)))
        hybrid = tree_core_registry.select_tree_core_backend(params((ComponentType.FULL, ComponentType.SWA)))
    assert (dense, hybrid) == ("rust", "dsv41_thin")
    assert receipts.counters["swa_thin"]["core:rust"] == 1
    assert receipts.counters["swa_thin"]["core:dsv41_thin"] == 1
    assert receipts.counters["swa_thin"]["fallback:cache has no SWA component (not a hybrid-SWA "
                                          "model); tree core and eviction order left to the engine"] == 1
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "fallback: cache has no SWA component" in m]
    assert [m for m in messages if "tree core: dsv41_thin instead of rust" in m]


def test_demote_binding_answers_each_node_and_moves_in_order(install_adapters, monkeypatch):
    """thin's core's `demote_swa_lru` (the binding thin proposes upstream) on the engine's real
    cache: one answer per node asked, in order (gone, root, tombstone, evicting, locked, session,
    moved); the moved nodes end at the evict-first end in the order given, and nothing else of
    the LRU or the tree changes."""
    import types
    from array import array

    from adapter.cpu import cpu_engine
    from adapter.swa_thin.core import SWA, ThinTreeCore
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    install_adapters(THIN)
    cpu = cpu_engine.build_swa_cache(full_tokens=64 * 256, swa_tokens=32 * 256, backend="rust")
    cache, core = cpu.cache, cpu.cache.tree_core
    assert type(core) is ThinTreeCore
    for tokens in (list(range(1, 4 * 256 + 1)), list(range(1, 2 * 256 + 1)) + list(range(5000, 5768))):
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=cpu.alloc(len(tokens))))
    lru, swa, root = core.lru_lists[SWA], core.components_by_type[SWA], core.root_node
    pt = lru._pt

    def order():
        out, x = [], lru.head.lru_next[pt]
        while x is not lru.tail:
            out.append(x.id)
            x = x.lru_next[pt]
        return out

    held = [i for i, n in core._node_arena.items() if n is not root]
    assert len(held) == 5 and all(i in lru.cache for i in held)
    first, second = held[1], held[3]
    before = order()
    assert core.demote_swa_lru([first, second]) == ["moved", "moved"]
    after = order()
    # the last one asked is the next victim (the tail end), the one before it just ahead of it
    assert after[-2:] == [first, second] and sorted(after) == sorted(before)
    assert [i for i in after if i not in (first, second)] == [i for i in before if i not in (first, second)]
    assert core.demote_swa_lru([10 ** 9, root.id]) == ["gone", "root"]
    # a lock on the deepest node: its SWA lock_ref is 1 (the window's nodes are locked)
    leaf = held[-1]
    lock = cache.lock(leaf)
    assert core._node_arena[leaf].component_data[SWA].lock_ref == 1
    assert core.demote_swa_lru([leaf]) == ["locked"]
    cache.unlock(lock)
    # an SWA eviction walk in progress (either sign of it): nothing moves
    monkeypatch.setattr(swa, "is_evict_device_ongoing", True)
    assert core.demote_swa_lru([first]) == ["evicting"]
    monkeypatch.setattr(swa, "is_evict_device_ongoing", False)
    monkeypatch.setitem(core._pending_internal_evictions, SWA, first)
    assert core.demote_swa_lru([first]) == ["evicting"]
    monkeypatch.delitem(core._pending_internal_evictions, SWA)
    # a session-referenced node (the engine's session partition reads _is_referenced)
    monkeypatch.setattr(lru, "_is_referenced", lambda node: node.id == held[0])
    assert core.demote_swa_lru([held[0], held[2]]) == ["session", "moved"]
    monkeypatch.setattr(lru, "_is_referenced", None)
    # SWA evicted from a node: a tombstone, not in the LRU any more
    victim = order()[-1]
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=256))
    assert core._node_arena[victim].component_data[SWA].value is None
    assert core.demote_swa_lru([victim]) == ["tombstone"]
    cache.sanity_check()
    # a core without an SWA component (the method reads only that): every node a tombstone
    assert ThinTreeCore.demote_swa_lru(types.SimpleNamespace(components_by_type={}), [1, 2]) == \
        ["tombstone", "tombstone"]


# ---- the move rule's edges, called directly (found by bench/mutation.py) ---------------------

def _fallbacks():
    from adapter import swa_thin

    return {k[len("fallback:"):]: v for k, v in swa_thin.counts().items() if k.startswith("fallback:")}


GONE = "lock node left the tree during the insert; order unchanged"


def test_the_hook_passes_the_engines_arguments_and_needs_no_lock():
    """The checkpoint hook calls the engine's checkpoint_into_tree with every argument and returns
    its result; a request without a lock (none yet, or no attribute) is counted, nothing moved."""
    import types

    from adapter import swa_thin

    swa_thin.reset_counts()
    seen = []
    cache = types.SimpleNamespace(tree_core=types.SimpleNamespace(is_root=lambda i: False))
    for req in (types.SimpleNamespace(last_node=5), types.SimpleNamespace(lock=None, last_node=5)):
        out = swa_thin._checkpoint_into_tree(lambda *a, **k: seen.append((a, k)) or "result",
                                             cache, req, "x", k=1)
        assert out == "result" and seen[-1] == ((cache, req, "x"), {"k": 1})
    c = swa_thin.counts()
    assert c["hooked_inserts"] == 2 and c["checkpoints_passed"] == 0 and not _fallbacks()


def test_window_nodes_cover_the_span_and_stop_at_the_root(install_adapters):
    """thin's window walk on the real tree (two sessions' chunk checkpoints, the engine's nodes of
    whatever lengths its inserts left): for each checkpoint and for spans at the nodes' own
    boundaries (a node's length, one token more, two nodes, to past the root), the nodes walked
    are those the token positions give (`_window`: every node on the root path reaching into the
    last `span` tokens), deepest first, and the walk stops at the root."""
    from adapter import swa_thin

    install_adapters(THIN)
    cpu = _build(backend="python")
    _, _, nodes = _two_sessions(cpu)
    core = cpu.cache.tree_core
    checked = 0
    for node_id in [n for name in ("S", "T") for n in nodes[name]]:
        node = core.node_by_id(node_id)
        first = len(node.key)
        second = first + (len(node.parent.key) if not core.is_root(node.parent.id) else 0)
        for span in (first, first + 1, second, second + 1, 10**9):
            got = [n.id for n in swa_thin._window_nodes(core, node, span)]
            assert got == _window(cpu.cache, node_id, span), (node_id, span)
            checked += 1
        assert all(not core.is_root(i) for i in got)
    assert checked >= 50


def _chain(install_adapters, window, pages=12):
    """thin's own core (ThinTreeCore, the core with the `demote_swa_lru` binding) in the engine's
    real cache with sliding window `window`: a chain of `pages` 256-token nodes, one page inserted
    past the last each time. Returns (cache, node ids root-first, with [0] the root's)."""
    from adapter.cpu import cpu_engine
    from adapter.swa_thin.core import ThinTreeCore
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    assert install_adapters(THIN)["swa_thin"].status == "installed"
    cpu = cpu_engine.build_swa_cache(full_tokens=64 * 256, swa_tokens=32 * 256, window=window,
                                     backend="rust")
    cache, core = cpu.cache, cpu.cache.tree_core
    assert cache.components[_swa_type()].sliding_window_size == window
    assert type(core) is ThinTreeCore
    ids = [core.root_node.id]
    for pages_ in range(1, pages + 1):
        tokens = list(range(1, pages_ * 256 + 1))
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=cpu.alloc(len(tokens))))
        (new,) = [i for i in core._node_arena if i not in ids]
        ids.append(new)
    assert [len(core.node_by_id(i).key) for i in ids[1:]] == [256] * pages
    return cache, ids


def _swa_type():
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return ComponentType.SWA


def _spy_binding(monkeypatch, core):
    """The node lists thin hands the core's binding, the binding itself still run."""
    calls, real = [], core.demote_swa_lru
    monkeypatch.setattr(core, "demote_swa_lru", lambda ids: calls.append(list(ids)) or real(ids))
    return calls


def _lru_order(cache):
    """SWA device LRU node ids, most recently used first (the last is the next victim)."""
    lru = cache.tree_core.lru_lists[_swa_type()]
    out, node = [], lru.head.lru_next[lru._pt]
    while node is not lru.tail:
        if node is not lru.mid:
            out.append(node.id)
        node = node.lru_next[lru._pt]
    return out


def _check_binding_path(install_adapters, monkeypatch):
    from adapter import swa_thin

    swa_thin.reset_counts()
    # window 640 + page 256: four nodes. Old 6 (6..3), new 7 (7..4): 6, 5, 4 kept, 3 moved.
    cache, n = _chain(install_adapters, window=640)
    calls = _spy_binding(monkeypatch, cache.tree_core)
    got = swa_thin.move_passed_checkpoint(cache, n[6], n[7])
    assert got == (1, 3), f"move returned {got}"
    assert calls == [[n[3]]] and swa_thin.counts()["kept:in-new-window"] == 3
    assert _lru_order(cache)[-1] == n[3], "the passed node is not at the evict-first end"
    # old 6, new 10: all four passed; the engine's lock on 4 holds the SWA of 4, 3 and 2 (its
    # window: 640 tokens), so 4 and 3 are kept, 6 and 5 moved (6 nearest the tail end)
    lock = cache.lock(n[4])
    locked = [i for i in n[1:] if cache.tree_core.node_by_id(i).component_data[_swa_type()].lock_ref]
    assert locked == [n[2], n[3], n[4]]
    got = swa_thin.move_passed_checkpoint(cache, n[6], n[10])
    cache.unlock(lock)
    assert got == (2, 2), f"move returned {got}"
    assert calls[-1] == [n[6], n[5], n[4], n[3]] and swa_thin.counts()["kept:locked"] == 2
    assert _lru_order(cache)[-2:] == [n[6], n[5]], "the passed nodes are not at the evict-first end"
    # old 1 (its window stops at the root), new 2 (2, 1): nothing passed, no call
    assert swa_thin.move_passed_checkpoint(cache, n[1], n[2]) == (0, 1)
    assert len(calls) == 2
    # a lock node that left the tree: the fallback, nothing called
    assert swa_thin.move_passed_checkpoint(cache, n[6], 10 ** 9) == (0, 0)
    assert _fallbacks() == {GONE: 1} and len(calls) == 2
    # a disabled cache (--disable-radix-cache) or one without SWA: left alone. The flags are set
    # on this populated cache (a disabled one holds no nodes to pass), so only they stop the move.
    for flag, value in (("disable", True), ("is_swa_enabled", False)):
        with monkeypatch.context() as m:
            m.setattr(cache, flag, value)
            assert swa_thin.move_passed_checkpoint(cache, n[6], n[12]) == (0, 0)
    assert len(calls) == 2
    cache.sanity_check()
    # window 1 + page 256 = 257 tokens: two nodes (the first covers 256 < 257)
    # window 256 + page 256 = 512 tokens: exactly two nodes
    for window in (1, 256):
        cache, n = _chain(install_adapters, window=window)
        calls = _spy_binding(monkeypatch, cache.tree_core)
        got = swa_thin.move_passed_checkpoint(cache, n[6], n[12])
        assert got == (2, 0), f"move returned {got} at window {window}"
        assert calls == [[n[6], n[5]]] and _lru_order(cache)[-2:] == [n[6], n[5]]


def test_the_binding_path_counts_every_node_and_calls_only_with_nodes_to_move(install_adapters,
                                                                              monkeypatch):
    """Through thin's core's demote_swa_lru on the engine's real cache (a chain of 256-token
    nodes; windows 640, 1 and 256): kept and moved counted per node, the binding called with the
    passed window deepest first minus the new window, and not at all when nothing was passed;
    the moved nodes end at the SWA LRU's evict-first end; the engine's own lock keeps its nodes;
    a gone lock node, a disabled or SWA-less cache left alone."""
    _check_binding_path(install_adapters, monkeypatch)


@pytest.mark.parametrize("broken", ["move is a no-op", "binding answers without moving"])
def test_the_binding_path_check_fails_on_a_broken_move(install_adapters, monkeypatch, broken):
    """The negative control of the test above: with thin's move through the binding a no-op, or
    with the core's binding answering "moved" for nodes it leaves where they were, its checks
    trip (so they rest on what thin does to the real LRU, not on the answers alone)."""
    from adapter import swa_thin
    from adapter.swa_thin.core import ThinTreeCore

    if broken == "move is a no-op":
        monkeypatch.setattr(swa_thin, "_move_through_binding", lambda *a: (0, 0))
        match = "move returned"
    else:
        monkeypatch.setattr(ThinTreeCore, "demote_swa_lru", lambda self, ids: ["moved"] * len(ids))
        match = "evict-first end"
    with pytest.raises(AssertionError, match=match):
        _check_binding_path(install_adapters, monkeypatch)


def test_a_core_with_neither_binding_nor_python_lru_keeps_the_engines_order(install_adapters):
    """The engine's Rust core (thin's key unset, so the engine keeps it): no demote binding and
    no Python SWA LRU; the move is a fallback, the order the engine's."""
    from adapter import swa_thin

    install_adapters({})
    cpu = _build(backend="rust")
    assert type(cpu.cache.tree_core).__name__ == "RustUnifiedTreeCore"
    swa_thin.reset_counts()
    assert swa_thin.move_passed_checkpoint(cpu.cache, 6, 7) == (0, 0)
    assert _fallbacks() == {"tree core RustUnifiedTreeCore has no Python SWA LRU; SWA eviction "
                            "order left to the engine": 1}


def test_window_ids_read_python_nodes_where_the_core_has_them(install_adapters, monkeypatch):
    """thin's core has Python nodes: the window is walked on them (collect_path_info, the path
    for cores without, is not called)."""
    from adapter import swa_thin

    install_adapters(THIN)
    cpu = _build(backend="rust")
    _two_sessions(cpu)
    core = cpu.cache.tree_core
    assert type(core).__name__ == "ThinTreeCore"
    leaf = max(core._node_arena)
    want = [n.id for n in swa_thin._window_nodes(core, core.node_by_id(leaf), 384)]
    monkeypatch.setattr(core, "collect_path_info", lambda ids: pytest.fail("read paths"), raising=False)
    assert swa_thin._window_ids(core, leaf, 384) == want and want



@pytest.mark.parametrize("span, nodes", [(1, 1), (256, 1), (257, 2), (512, 2), (513, 3), (4096, 4)])
def test_window_ids_walk_the_path_of_a_core_without_python_nodes(span, nodes):
    """The engine's Rust core (thin not installed: no Python nodes) gives the window through
    collect_path_info: the nodes from the deepest up until `span` tokens are covered, a node that
    reaches past the window's start included, none beyond it (a chain of four 256-token nodes)."""
    from adapter import swa_thin
    from adapter.cpu import cpu_engine
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cpu = cpu_engine.build_swa_cache(full_tokens=64 * 256, swa_tokens=32 * 256, backend="rust")
    core = cpu.cache.tree_core
    assert type(core).__name__ == "RustUnifiedTreeCore" and getattr(core, "_node_arena", None) is None
    tokens = list(range(1, 4 * 256 + 1))
    for k in range(1, 5):                           # one node per 256 tokens
        cpu.cache.insert(InsertParams(key=RadixKey(array("q", tokens[:k * 256])), value=cpu.alloc(k * 256)))
    leaf = cpu.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).last_device_node
    path = core.collect_path_info([leaf])[0]
    assert [p.path_end - p.path_start for p in path] == [256] * 4
    deepest_first = [p.node_id for p in reversed(path)]
    assert swa_thin._window_ids(core, leaf, span) == deepest_first[:nodes]

def test_python_core_moves_the_lrus_only_node_and_reports_a_gone_lock_node(install_adapters, monkeypatch):
    """The engine's Python core (thin's own core off): relinking the only node of the SWA LRU
    (the list is empty after its removal: insert_mru), and a lock node that left the tree."""
    from adapter import swa_thin
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    monkeypatch.setattr(swa_thin, "OWN_CORE", False)
    install_adapters(THIN)
    swa_thin.reset_counts()
    cpu = _build()
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cpu.cache.insert(InsertParams(key=RadixKey(array("q", range(1, 257))), value=cpu.alloc(256)))
    core = cpu.cache.tree_core
    assert type(core).__name__ == "UnifiedTreeCore"
    lru = core.lru_lists[ComponentType.SWA]
    (only,) = lru.cache.values()
    swa_thin._to_evict_first_end(lru, only)
    assert lru.cache == {only.id: only} and lru.tail.lru_prev[lru._pt] is only
    assert lru.head.lru_next[lru._pt] is only
    assert swa_thin.move_passed_checkpoint(cpu.cache, 10 ** 9, only.id) == (0, 0)
    assert _fallbacks() == {GONE: 1}
    cpu.cache.sanity_check()


def test_python_core_path_keeps_by_reason(install_adapters, monkeypatch):
    """The engine's Python core (thin's own core off): a passed window's nodes kept per reason
    (in the new window, an SWA eviction walk in progress, locked, session-referenced), counted
    once each; a tombstone is skipped, the nodes after it still move."""
    from adapter import swa_thin
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    monkeypatch.setattr(swa_thin, "OWN_CORE", False)
    install_adapters(THIN)
    cpu = _build()
    cache = cpu.cache
    core = cache.tree_core
    assert type(core).__name__ == "UnifiedTreeCore"
    ids = []
    for pages in (1, 2, 3, 4, 5):                     # a chain of five 256-token nodes
        tokens = list(range(1, pages * 256 + 1))
        cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=cpu.alloc(len(tokens))))
        ids.append(max(i for i in core._node_arena if i not in ids and core._node_arena[i] is not core.root_node))
    n1, n2, n3, n4, n5 = ids
    swa = core.components_by_type[ComponentType.SWA]
    lru = core.lru_lists[ComponentType.SWA]

    def counts():
        return {k: v for k, v in swa_thin.counts().items() if k.startswith("kept:")}

    # window 128 + page 256: two nodes. old n3 (n3, n2), new n4 (n4, n3): n3 kept, n2 moved
    swa_thin.reset_counts()
    assert swa_thin.move_passed_checkpoint(cache, n3, n4) == (1, 1)
    assert counts() == {"kept:in-new-window": 1}
    swa_thin.reset_counts()
    monkeypatch.setattr(swa, "is_evict_device_ongoing", True)
    assert swa_thin.move_passed_checkpoint(cache, n3, n5) == (0, 2)
    assert counts() == {"kept:evicting": 2}
    monkeypatch.setattr(swa, "is_evict_device_ongoing", False)
    swa_thin.reset_counts()
    lock = cache.lock(n3)                       # SWA-locks the window of n3: n3 itself
    assert swa_thin.move_passed_checkpoint(cache, n3, n5) == (1, 1)
    assert counts() == {"kept:locked": 1}
    cache.unlock(lock)
    swa_thin.reset_counts()
    monkeypatch.setattr(lru, "_is_referenced", lambda node: node.id == n2)
    assert swa_thin.move_passed_checkpoint(cache, n3, n5) == (1, 1)
    assert counts() == {"kept:session": 1}
    monkeypatch.setattr(lru, "_is_referenced", None)
    # n3 tombstoned (moved to the evict-first end, then one SWA page evicted): skipped, n2 moves
    swa_thin._to_evict_first_end(lru, core._node_arena[n3])
    cache.evict(EvictParams(num_tokens=0, swa_num_tokens=256))
    assert core._node_arena[n3].component_data[ComponentType.SWA].value is None
    swa_thin.reset_counts()
    assert swa_thin.move_passed_checkpoint(cache, n3, n5) == (1, 0)
    cache.sanity_check()
