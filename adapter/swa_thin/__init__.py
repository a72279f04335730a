"""swa_thin (`DSV41_SWA_THIN=1`): moved-past SWA checkpoints go to the evict-first end of the SWA LRU.

A cached prefix is resumable only at a node whose last sliding window still holds SWA slots. Every
chunk of a chunked prefill and every agent turn leaves such a checkpoint (its window is two SWA
pages in two tree nodes at page 256 / window 128). In stock LRU order the checkpoints that their
own request has already moved past sit ahead of an idle session's only live resume point, so that
point is evicted first and the session's next turn re-prefills everything.

What this adapter does, and nothing more:
- `UnifiedRadixCache.checkpoint_into_tree` (every chunk checkpoint and the final insert of a
  request): the engine unlocks the request's old lock node and locks the node the insert ended on.
  When those differ, the request has moved past the old node's checkpoint: the SWA-bearing nodes
  of that checkpoint's window (the same span the engine refreshes at MATCH_END / INSERT_END:
  sliding window + one page, walking up from the node) are moved to the evict-first end of the
  SWA LRU. The first checkpoint of a request moves its prefix-match node (its admission lock), so
  the prefix-match node of a request that made no chunked step is covered by the same rule.
  Kept in place: nodes still locked (another live request reads them), nodes of the new window
  (short extends overlap it), session-referenced nodes (the engine's session partition).
  No node is freed, locked, split or resized; sizes and lock refs are untouched.
- `tree_core_registry.select_tree_core_backend`: neither engine core exposes a way to reorder
  the SWA LRU on the engine default (Rust: no binding reaches its LRU). For a FULL + SWA cache
  where the engine would run rust or python, thin selects its own core instead: "dsv41_thin"
  (adapter/swa_thin/core.py), a subclass of the engine's Python core registered with the
  engine's `register_tree_core_backend`, same tree, without the Python core's per-node tolls
  (offset insert walk, page-compare child lookup, inlined lock walks). It exposes
  `demote_swa_lru(node_ids)`, the binding thin proposes upstream
  (docs/upstream/swa-lru-demote.md), and thin moves through it. A core that already exposes that
  binding is kept as it is (the day the Rust core has it). Other SWA caches (with Mamba) get the
  engine's Python core, moved through its `UnifiedLRUList`. A cache without an SWA component (a
  dense model) keeps Rust, with a fallback line. One receipt line per cache built on a switched
  core; bench/thin_core_cost.py measures what each core costs.

Receipt: one line every 1024 hooked inserts with the moved / kept counts.

On a contained exception: a failed move (`move failed (<type>)`) leaves that checkpoint's SWA LRU
order exactly as the engine had it (a window is moved whole or not at all; the insert itself
stands); a failed core switch (`tree core switch failed`) leaves the engine's own core choice.
"""
from __future__ import annotations

from adapter import receipts

NAME = "swa_thin"
RECEIPT_EVERY = 1024

# Counter keys in receipts.counters["swa_thin"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "hooked_inserts": "checkpoint_into_tree calls seen",
    "checkpoints_passed": "checkpoints whose request moved past them",
    "nodes_moved": "SWA LRU nodes moved to the evict-first end",
    "kept:": "nodes of a passed checkpoint left in place, by reason (in-new-window, locked, session)",
    "core:": "caches built, by the tree core serving them (rust, python, dsv41_thin)",
}

THIN_CORE = "dsv41_thin"            # thin's own tree core, as registered with the engine
OWN_CORE = True                     # False: FULL+SWA caches get the engine's Python core, as before
                                    # issue 25 (the bench's reference row, equivalence tests)
DEMOTE_BINDING = "demote_swa_lru"   # the binding thin moves through where a core exposes it
# Engine backends thin may switch, and the class each builds (a class exposing DEMOTE_BINDING is
# kept): name -> (module, class).
ENGINE_CORES = {
    "rust": ("sglang.srt.mem_cache.rust_tree_core.adapter", "RustUnifiedTreeCore"),
    "python": ("sglang.srt.mem_cache.unified_cache.unified_tree_core", "UnifiedTreeCore"),
}


# fallback:<reason> is counted by receipts.fallback, as for every adapter.
KEPT = "kept:"
_at_last_line = {"checkpoints_passed": 0, "nodes_moved": 0, "kept": 0}   # totals at the last receipt


def counts():
    return receipts.counters[NAME]


def summary() -> dict:
    """Thin's counts, read from receipts.counters["swa_thin"] (tests, sims, receipts)."""
    c = counts()
    return {"hooked_inserts": c["hooked_inserts"], "checkpoints_passed": c["checkpoints_passed"],
            "nodes_moved": c["nodes_moved"],
            "kept": {k[len(KEPT):]: v for k, v in sorted(c.items()) if k.startswith(KEPT)},
            "core": {k[len("core:"):]: v for k, v in sorted(c.items()) if k.startswith("core:")}}


def reset_counts() -> None:
    """Forget thin's counters and logged-once fallback reasons (tests)."""
    receipts.forget(NAME)
    _at_last_line.update(checkpoints_passed=0, nodes_moved=0, kept=0)


_SWA = None          # ComponentType.SWA, resolved on first use (the engine imports after us)


def _swa_type():
    global _SWA
    if _SWA is None:
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        _SWA = ComponentType.SWA
    return _SWA


def _swa_lru(cache):
    """(tree core, SWA component, SWA device LRU) of a cache thin can act on, else None."""
    if cache.disable or not cache.is_swa_enabled:
        return None
    core = cache.tree_core
    lru_lists = getattr(core, "lru_lists", None)
    if lru_lists is None:
        receipts.fallback(NAME, f"tree core {type(core).__name__} has no Python SWA LRU; "
                                "SWA eviction order left to the engine")
        return None
    swa = _swa_type()
    return core, cache.components[swa], lru_lists[swa]


def _window_nodes(core, node, span):
    """Nodes of the checkpoint window ending at `node`: walk up while < span tokens are covered."""
    out = []
    covered = 0
    root = core.root_node
    while node is not None and node is not root and covered < span:
        out.append(node)
        covered += len(node.key)
        node = node.parent
    return out


def _to_evict_first_end(lru, node) -> None:
    """Relink `node` just before the tail sentinel: the next SWA eviction walk starts there.
    On failure the node is put back where it was (it never leaves the LRU)."""
    prev = node.lru_prev[lru._pt]
    lru.remove_node(node)
    try:
        last = lru.tail.lru_prev[lru._pt]
        if last is lru.head or last is lru.mid:
            # Empty (unreferenced part of the) list: insert_mru lands right before the tail.
            lru.insert_mru(node)
        else:
            lru.insert_after(last, node)
    except BaseException:
        _put_back(lru, node, prev)
        raise


def _put_back(lru, node, prev) -> None:
    """Relink `node` right after `prev` (its predecessor before a move) as an LRU member."""
    if node.id in lru.cache:
        lru.remove_node(node)
    lru.cache[node.id] = node
    lru._add_node_after(prev, node)


def _move_all(lru, nodes) -> None:
    """Move `nodes` to the evict-first end in order, all or none: on a failure the ones already
    moved go back, in reverse, after their old predecessors (each undo restores exactly the
    list the move started from), so a checkpoint's window is never left half moved."""
    done = []
    try:
        for node in nodes:
            prev = node.lru_prev[lru._pt]
            _to_evict_first_end(lru, node)
            done.append((node, prev))
    except BaseException:
        for node, prev in reversed(done):
            _put_back(lru, node, prev)
        raise


def move_passed_checkpoint(cache, old_id, new_id) -> tuple[int, int]:
    """Move the window of checkpoint `old_id` (passed by its request, now at `new_id`) to the
    evict-first end of the SWA LRU. Returns (moved, kept) node counts.

    Through the core's `demote_swa_lru` binding where it has one (thin's own core; a future engine
    core), else by relinking a Python core's `UnifiedLRUList` (the engine's Python core)."""
    if cache.disable or not cache.is_swa_enabled:
        return 0, 0
    core = cache.tree_core
    demote = getattr(core, DEMOTE_BINDING, None)
    if demote is not None:
        return _move_through_binding(cache, core, demote, old_id, new_id)
    found = _swa_lru(cache)
    if found is None:
        return 0, 0
    core, swa, lru = found
    try:
        old = core.node_by_id(old_id)
        new = core.node_by_id(new_id)
    except KeyError:
        receipts.fallback(NAME, "lock node left the tree during the insert; order unchanged")
        return 0, 0
    span = swa.sliding_window_size + core.page_size
    live = {n.id for n in _window_nodes(core, new, span)}   # 2-3 nodes at page 256 / window 128
    ct = swa.component_type
    in_lru = lru.cache
    referenced = lru._is_referenced
    # A suspended SWA eviction walk keeps its cursor sentinel in the list (as the binding does).
    evicting = getattr(swa, "is_evict_device_ongoing", False)
    to_move, kept = [], []
    # Deepest first, so the checkpoint's oldest node ends nearest the tail (as the engine orders).
    # Decided first (reads only), then moved whole: relinks LRU pointers only, not the tree.
    for node in _window_nodes(core, old, span):
        cd = node.component_data[ct]
        if cd.value is None or node.id not in in_lru:
            continue                      # tombstone: nothing in the SWA LRU to move
        if node.id in live:
            kept.append("in-new-window")
        elif evicting:
            kept.append("evicting")
        elif cd.lock_ref > 0:
            kept.append("locked")
        elif referenced is not None and referenced(node):
            kept.append("session")
        else:
            to_move.append(node)
    _move_all(lru, to_move)
    c = counts()
    for reason in kept:
        c[KEPT + reason] += 1
    return len(to_move), len(kept)


# Binding outcomes that are not a kept checkpoint node (nothing in the SWA LRU to move).
_NOT_IN_LRU = ("gone", "root", "tombstone")


def _move_through_binding(cache, core, demote, old_id, new_id) -> tuple[int, int]:
    """The same rule through `demote_swa_lru`: the old window deepest first, minus the nodes of
    the new window (kept, unless tombstoned), in one call."""
    swa = _swa_type()
    span = cache.components[swa].sliding_window_size + core.page_size
    try:
        old_window = _window_ids(core, old_id, span)
        live = set(_window_ids(core, new_id, span))
    except KeyError:
        receipts.fallback(NAME, "lock node left the tree during the insert; order unchanged")
        return 0, 0
    c = counts()
    kept = 0
    ids = []
    for node_id in old_window:
        if node_id not in live:
            ids.append(node_id)
        elif core.get_component_device_value(node_id, swa) is not None:
            c[KEPT + "in-new-window"] += 1
            kept += 1
    moved = 0
    for outcome in demote(ids) if ids else ():
        if outcome == "moved":
            moved += 1
        elif outcome not in _NOT_IN_LRU:
            c[KEPT + outcome] += 1
            kept += 1
    return moved, kept


def _window_ids(core, node_id, span) -> list:
    """Ids of the checkpoint window ending at `node_id`, deepest first: from the Python nodes of
    a Python core, else from the core's `collect_path_info` (every core has it)."""
    node_by_id = getattr(core, "node_by_id", None)
    if getattr(core, "_node_arena", None) is not None and node_by_id is not None:
        return [n.id for n in _window_nodes(core, node_by_id(node_id), span)]
    ids, covered = [], 0
    for info in reversed(core.collect_path_info([node_id])[0]):
        if covered >= span:
            break
        ids.append(info.node_id)
        covered += info.path_end - info.path_start
    return ids


def _checkpoint_into_tree(original, self, req, *args, **kwargs):
    lock = getattr(req, "lock", None)
    old_id = lock.node if lock is not None else None
    result = original(self, req, *args, **kwargs)       # the engine's exceptions propagate
    try:
        c = counts()
        c["hooked_inserts"] += 1
        new_id = req.last_node
        if (old_id is not None and new_id is not None and new_id != old_id
                and not self.tree_core.is_root(old_id)):
            moved, _ = move_passed_checkpoint(self, old_id, new_id)
            c["checkpoints_passed"] += 1
            c["nodes_moved"] += moved
        if c["hooked_inserts"] % RECEIPT_EVERY == 0:
            _receipt_line(c)
    except Exception as exc:  # noqa: BLE001 - thin's own logic only: the insert stands
        receipts.fallback(NAME, f"move failed ({type(exc).__name__}); this checkpoint "
                                "keeps the engine's SWA LRU order")
    return result


def _receipt_line(c) -> None:
    kept = {k[len(KEPT):]: v for k, v in sorted(c.items()) if k.startswith(KEPT)}
    total_kept = sum(kept.values())
    since = _at_last_line
    receipts.line(NAME, "%d hooked inserts: %d checkpoints passed, %d SWA nodes moved to the "
                  "evict-first end, %d kept (total moved %d, kept %d: %s)",
                  c["hooked_inserts"], c["checkpoints_passed"] - since["checkpoints_passed"],
                  c["nodes_moved"] - since["nodes_moved"], total_kept - since["kept"],
                  c["nodes_moved"], total_kept,
                  ", ".join(f"{r} {n}" for r, n in kept.items()) or "-")
    since.update(checkpoints_passed=c["checkpoints_passed"], nodes_moved=c["nodes_moved"],
                 kept=total_kept)


def _select_tree_core_backend(original, params, *args, **kwargs):
    name = original(params, *args, **kwargs)
    if name in ENGINE_CORES:
        try:
            name = _switch(name, params)
        except Exception as exc:  # noqa: BLE001 - thin's own logic only: the engine's choice stands
            receipts.fallback(NAME, f"tree core switch failed ({type(exc).__name__}); the "
                                    f"engine's {name} core serves this cache")
    counts()[f"core:{name}"] += 1
    return name


def _switch(name: str, params) -> str:
    """The core thin runs a cache on where the engine chose `name` (rust or python)."""
    components = set(getattr(params, "tree_components", None) or ())
    swa = _swa_type()
    if swa not in components:
        if name == "rust":
            # Nothing to reorder in a cache without an SWA component (a dense model): keep Rust.
            receipts.fallback(NAME, "cache has no SWA component (not a hybrid-SWA model); tree core "
                                    "and eviction order left to the engine")
        return name
    if _exposes_demote(name):
        receipts.line(NAME, "tree core: %s kept (it exposes %s, which thin moves through)",
                      name, DEMOTE_BINDING)
        return name
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    if OWN_CORE and components == {ComponentType.FULL, swa}:
        _register_core()
        receipts.line(NAME, "tree core: %s instead of %s (thin's subclass of the engine's Python "
                      "core: same tree, no per-node slicing; the engine's cores expose no way to "
                      "reorder the SWA LRU, DSV41_SWA_THIN=1 does; unset the key for %s)",
                      THIN_CORE, name, name)
        return THIN_CORE
    if name == "rust":
        # Other SWA stacks (Mamba too): the engine's Python core, whose LRU thin relinks.
        receipts.line(NAME, "tree core: python instead of rust (DSV41_SWA_THIN=1 reorders the SWA "
                      "LRU, which the Rust core keeps out of Python's reach; unset the key for rust)")
        return "python"
    return name


def _engine_core_class(name: str):
    """The class engine backend `name` builds, or None (not importable here)."""
    import importlib

    module, cls = ENGINE_CORES[name]
    try:
        return getattr(importlib.import_module(module), cls, None)
    except Exception:                # e.g. the Rust extension does not load here: no binding
        return None


def _exposes_demote(name: str) -> bool:
    return callable(getattr(_engine_core_class(name), DEMOTE_BINDING, None))


def _thin_core_factory(params, components):
    from adapter.swa_thin.core import ThinTreeCore

    return ThinTreeCore(params, components)


def _register_core() -> None:
    """Register thin's core with the engine's registry, once per process (install and every
    switch call it; the registry refuses a second registration of one name)."""
    from sglang.srt.mem_cache.unified_cache import tree_core_registry as registry

    if registry.get_tree_core_factory(THIN_CORE) is None:
        registry.register_tree_core_backend(THIN_CORE, _thin_core_factory)


def _check_lru_api() -> None:
    from adapter.refusal import Refusal
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedLRUList

    missing = [a for a in ("remove_node", "insert_after", "insert_mru") if not hasattr(UnifiedLRUList, a)]
    if missing:
        raise Refusal(f"UnifiedLRUList lacks {', '.join(missing)}")


def install(ctx) -> str:
    _check_lru_api()
    _register_core()
    ctx.around("UnifiedRadixCache.checkpoint_into_tree", _checkpoint_into_tree)
    ctx.around("select_tree_core_backend", _select_tree_core_backend)
    return (f"DSV41_SWA_THIN={ctx.value('DSV41_SWA_THIN')}: moved-past checkpoints to the SWA "
            f"LRU's evict-first end; tree core {THIN_CORE} for FULL+SWA caches (rust / python "
            f"selections switched; thin's subclass of the engine's Python core); receipt every "
            f"{RECEIPT_EVERY} inserts")
