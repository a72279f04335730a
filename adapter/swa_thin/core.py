"""Thin's own tree core: the engine's Python tree core (`UnifiedTreeCore`) with its hot paths
rewritten, registered with the engine as the backend "dsv41_thin" (adapter/swa_thin/__init__.py).

Same tree, same values, sizes, locks, LRU orders and eviction victims as the engine's Python core
(tests/test_swa_thin_core*.py prove it on the real cache classes); only how the walks get there
changes:
- Insert walk: the remaining key is an offset into the insert key (`state.total_prefix_length`,
  which is exactly how far the walk has consumed it), not a fresh slice per node. The engine's
  walk copies the rest of the key at every node (`state.key = state.key[prefix_len:]`): length
  x depth, ~55 % of a chunk checkpoint at 500K depth.
- Child lookup (insert and match walks): the engine builds the child's dict key, a tuple of the
  next page's 256 token ids (one int object each) and hashes it, at every node (~20 us). A node
  with a few children is searched by comparing each child's first page as an array slice, which
  is the same test (the children dict is keyed by exactly that page and the key's namespace).
- Node key compare: one array-slice equality of the node's whole key (C memcmp-like) instead of
  the engine's galloping `RadixKey.match_at`; a node that does not match whole (the last one of a
  walk) still goes through `match_at`.
- Walk-down touch: SWA's WALKDOWN refresh is a no-op, so the walk sets the access time only.
- Lock / unlock: the Full path walk inlined (no per-node method calls, `shape[0]` for the value
  length, one ledger update per walk), and the evictable-leaf-set update without generators.
Each fast path runs only where the engine's own code would do exactly the same: plain keys (no
bigram / EAGLE keys, array token ids; a node key with a `limit` is compared by the engine), the
engine's own FullComponent / SWAComponent classes (a subclass may redefine what a path does), no
HiCache device/host split in a match.
Anything else goes to the engine's method.

It also exposes `demote_swa_lru(node_ids)`, the binding thin proposes upstream
(docs/upstream/swa-lru-demote.md): thin's order is applied through it.
"""
from __future__ import annotations

from array import array

from sglang.srt.mem_cache.base_prefix_cache import IncLockRefResult
from sglang.srt.mem_cache.unified_cache.components import (
    BASE_COMPONENT_TYPE,
    ComponentType,
    FullComponent,
    SWAComponent,
    get_and_increase_time_counter,
)
from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore, _InsertPhase

FULL = BASE_COMPONENT_TYPE
SWA = ComponentType.SWA
SCAN_MAX = 16            # children compared page by page; more than this: the engine's dict key
DEMOTE_BINDING = "demote_swa_lru"


class ThinTreeCore(UnifiedTreeCore):
    """UnifiedTreeCore with an offset insert walk and lighter per-node paths (module docstring)."""

    # Set in __init__ (after the engine's own __init__, which builds the tree through reset()).
    _plain_walk = False       # keys are plain token arrays: page compares, offset slices
    _fast_full = False        # Full lock walks inlined (the engine's own FullComponent)
    _walkdown_noop = False    # every auxiliary component's WALKDOWN refresh is a no-op (SWA)

    def __init__(self, params, components):
        super().__init__(params, components)
        comps = self.components_by_type
        self._plain_walk = not self.is_eagle
        self._fast_full = type(comps.get(FULL)) is FullComponent
        self._walkdown_noop = all(type(c) is SWAComponent for ct, c in comps.items() if ct != FULL)

    # ---- child lookup and node compare (insert and match walks) ----------------------------

    def _child_at(self, node, key, off):
        """The child of `node` whose first page is key[off:off+page] (same namespace), or None:
        what `node.children.get(key.child_key_at(off, page))` returns, without the tuple."""
        children = node.children
        if not children:
            return None
        page = self.page_size
        if len(children) > SCAN_MAX:
            return children.get(key.child_key_at(off, page))
        first = key.token_ids[off:off + page]
        ek, salt = key.extra_key, key.cache_salt
        for child in children.values():
            ck = child.key
            ct = ck.token_ids
            if type(ct) is not array:
                return children.get(key.child_key_at(off, page))
            if ct[:page] == first and ck.extra_key == ek and ck.cache_salt == salt:
                return child
        return None

    def _match_len(self, ck, key, off, n):
        """`ck.match_at(key, off, page_size)` for a node key `ck`; one slice compare when the
        whole node key matches."""
        kt = ck.token_ids
        size = len(kt)
        if ck.limit is None and off + size <= n and type(kt) is array and key.token_ids[off:off + size] == kt:
            page = self.page_size
            return size if page == 1 else size // page * page
        return ck.match_at(key, off, page_size=self.page_size)

    def _plain(self, key) -> bool:
        """A key the page compares may read: token ids in an array, no bigram view. (A `limit` on
        it is fine: the walks read it only below len(key), which honours the limit.)"""
        return self._plain_walk and not key.is_bigram and type(key.token_ids) is array

    # ---- insert walk: offset instead of slices ----------------------------------------------
    # state.key stays the whole (page-aligned) insert key; the walk's position in it is
    # state.total_prefix_length, which the engine's walk advances by exactly the prefix it
    # consumes (its remaining key was always key[total_prefix_length:]).

    def _insert_walk_step(self, state) -> None:
        key = state.key
        off = state.total_prefix_length
        n = len(key)
        if off >= n:
            state.phase = _InsertPhase.COMMIT
            return
        if self._plain(key) and n - off >= self.page_size:
            child = self._child_at(state.node, key, off)
        else:
            child = state.node.children.get(key.child_key_at(off, self.page_size))
        if child is None:
            state.phase = _InsertPhase.COMMIT
            return
        step_actions = state.pending_actions
        node = child
        self._touch_node(node)
        if self._plain(key):
            prefix_len = self._match_len(node.key, key, off, n)
        else:
            prefix_len = node.key.match_at(key, off, page_size=self.page_size)
        if prefix_len < len(node.key):
            node, action = self._split_node(node.key, node, prefix_len)
            if action is not None:
                step_actions.append(action)
        node.priority = max(node.priority, state.priority)

        if node.evicted:
            self._unevict_node_on_insert(node, state.value[:prefix_len],
                                         session_id=state.params.session_id)
            state.result.record_adopted_range(FULL, off, off + prefix_len)
            for component in self.components:
                if component.component_type == FULL:
                    continue
                component.recover_after_unevict(node=node, prefix_len=prefix_len, total_prefix_len=off,
                                                params=state.params, result=state.result,
                                                cache_actions=step_actions)
            self._finish_insert_walk_node(state, node, prefix_len)
            return
        state.overlap_node = node
        state.overlap_prefix_len = prefix_len
        state.phase = _InsertPhase.OVERLAP
        self._insert_overlap_step(state)

    def _finish_insert_walk_node(self, state, node, prefix_len: int) -> None:
        node_end = state.total_prefix_length + prefix_len
        if node_end > state.params.inserted_len and self._inc_hit_count_and_check(node):
            state.pending_actions.append(self._build_backup_kv_action(node))
        state.node = node
        state.total_prefix_length = node_end          # the offset into state.key
        state.value = state.value[prefix_len:]        # a view, not a copy
        state.overlap_node = None
        state.overlap_prefix_len = 0
        state.phase = _InsertPhase.WALK

    def _insert_commit_step(self, state) -> None:
        off = state.total_prefix_length
        rest = len(state.key) - off
        if rest:
            state.result.record_adopted_range(FULL, off, off + rest)
            state.target_node = self._add_new_node(
                state.node, state.key[off:] if off else state.key, state.value,
                priority=state.priority, session_id=state.params.session_id,
                rotation_base=state.params.rotation_base)
            state.is_new_leaf = True
        else:
            state.target_node = state.node
        state.result.prefix_len = off
        state.result.last_device_node = state.target_node.id
        for component in self.components:
            component.commit_insert_component_data(node=state.target_node, is_new_leaf=state.is_new_leaf,
                                                   params=state.params, result=state.result,
                                                   cache_actions=state.pending_actions)
        state.phase = _InsertPhase.TAIL

    def _touch_node(self, node) -> None:
        if self._walkdown_noop:
            node.last_access_time = get_and_increase_time_counter()   # SWA's WALKDOWN: no-op
            return
        super()._touch_node(node)

    # ---- match walk --------------------------------------------------------------------------

    def _match_prefix_helper(self, key, params):
        if self.enable_hicache or not self._plain(key):
            return super()._match_prefix_helper(key, params)
        page = self.page_size
        n = len(key)
        node = self.root_node
        off = 0
        value = []
        best_match_node = best_match_device_node = node
        best_match_device_value_len = 0
        full_kv_hit_length = 0
        action = None
        validators = self._create_match_validators(params, match_device_only=True)
        while off < n:
            child = self._child_at(node, key, off) if n - off >= page else \
                node.children.get(key.child_key_at(off, page))
            if child is None:
                break
            cd = child.component_data[FULL]
            evicted = cd.value is None            # a child always has a parent
            if evicted and cd.host_value is None:
                break
            prefix_len = self._match_len(child.key, key, off, n)
            full_kv_hit_length += prefix_len
            split = prefix_len < len(child.key)
            if split:
                node, action = self._split_node(child.key, child, prefix_len)
                v = node.component_data[FULL].value
                if v is not None:
                    value.append(v)
            else:
                if not evicted:
                    value.append(cd.value)
                node = child
            matched = True
            for validator in validators:          # every validator sees every node (state)
                if not validator(node):
                    matched = False
            if matched:
                best_match_node = best_match_device_node = node
                best_match_device_value_len = len(value)
            if split:
                break
            off += prefix_len
        return self._match_post_processor(
            params, value, best_match_node, best_match_device_node, best_match_device_value_len,
            full_kv_hit_length, action,
            last_visited_node_id=node.id if node is not self.root_node else None,
            device_validators=validators)

    # ---- lock / unlock -----------------------------------------------------------------------

    def inc_lock_ref(self, node_id, skip_lock_components=()):
        if not self._fast_full:
            return super().inc_lock_ref(node_id, skip_lock_components)
        node = self.node_by_id(node_id)
        skipped = tuple(skip_lock_components)
        result = IncLockRefResult(node_id=node.id, skipped_lock_components=skipped)
        for component in self.components:
            ct = component.component_type
            if ct in skipped:
                continue
            if ct == FULL:
                result.delta = self._lock_full_path(node)
            else:
                result = component.acquire_component_lock(node=node, result=result)
        self._update_evictable_leaf_sets(node)
        return result

    def _lock_full_path(self, node) -> int:
        """FullComponent.acquire_component_lock(node, result) without lock_host: returns delta."""
        root = self.root_node
        cur = node
        while cur is not root:                 # the bottom device-evicted segment: refs only
            cd = cur.component_data[FULL]
            if cd.value is not None:
                break
            cd.lock_ref += 1
            cur = cur.parent
        delta = 0
        leaves = self.evictable_device_leaves
        try:
            while cur is not root:
                cd = cur.component_data[FULL]
                value = cd.value
                assert value is not None, (
                    f"FULL invariant broken: evicted ancestor {cur.id} above device-on segment")
                if cd.lock_ref == 0:
                    delta += value.shape[0]
                cd.lock_ref += 1
                leaves.discard(cur)
                cur = cur.parent
        finally:
            self.component_evictable_size_[FULL] -= delta
            self.component_protected_size_[FULL] += delta
        return delta

    def _release_components(self, node, params, *, lock_host=False, skip_swa_and_below=False):
        if lock_host or not self._fast_full:
            return super()._release_components(node, params, lock_host=lock_host,
                                               skip_swa_and_below=skip_swa_and_below)
        swa_priority = None
        if skip_swa_and_below:
            swa_component = self.components_by_type.get(SWA)
            if swa_component is not None:
                swa_priority = swa_component.eviction_priority(is_leaf=False)
        for component in reversed(self.components):
            ct = component.component_type
            if ct in params.skipped_lock_components:
                continue
            if swa_priority is not None and (
                    ct == SWA or component.eviction_priority(is_leaf=False) < swa_priority):
                continue
            if ct == FULL:
                self._unlock_full_path(node)
            else:
                component.release_component_lock(node=node, params=params, lock_host=False)

    def _unlock_full_path(self, node) -> None:
        """FullComponent.release_component_lock(node, params) without lock_host."""
        root = self.root_node
        cur = node
        delta = 0
        update = self._update_evictable_leaf_sets
        try:
            while cur is not root:
                cd = cur.component_data[FULL]
                ref = cd.lock_ref
                assert ref > 0, f"FULL segment release hit lock_ref=0 on node {cur.id}"
                if ref == 1 and cd.value is not None:
                    delta += cd.value.shape[0]
                cd.lock_ref = ref - 1
                if ref == 1:
                    update(cur)
                cur = cur.parent
        finally:
            self.component_evictable_size_[FULL] += delta
            self.component_protected_size_[FULL] -= delta

    def _update_evictable_leaf_sets(self, node) -> None:
        """The engine's rule (`_is_device_leaf`, `_is_host_leaf`), without generator calls."""
        dev, host = self.evictable_device_leaves, self.evictable_host_leaves
        if node is self.root_node:
            dev.discard(node)
            host.discard(node)
            return
        cds = node.component_data
        full = cds[FULL]
        evicted = full.value is None and node.parent is not None
        locked = False
        for cd in cds:
            if cd.lock_ref > 0:
                locked = True
                break
        if evicted or locked:
            dev.discard(node)
        else:
            for child in node.children.values():
                if child.component_data[FULL].value is not None:
                    dev.discard(node)
                    break
            else:
                dev.add(node)
        if not evicted or locked or full.host_value is None or node.children:
            host.discard(node)
            return
        for cd in cds:
            if cd.host_lock_ref > 0:
                host.discard(node)
                return
        host.add(node)

    # ---- the binding thin proposes upstream ---------------------------------------------------

    def demote_swa_lru(self, node_ids) -> list[str]:
        """Move each listed node's SWA device LRU entry to the evict-first end, in order (so the
        last one moved is the next victim). Per node: "moved", or why it was left alone:
        "gone" (not in the tree), "root", "tombstone" (no SWA device value / not in the LRU),
        "evicting" (an SWA eviction walk is in progress), "locked" (SWA lock_ref > 0),
        "session" (session-referenced: the engine's session partition). Nothing but LRU links
        changes: no value, size, lock or LRU membership. All or nothing: if a relink raises, the
        nodes already moved go back to where they were and the exception propagates."""
        swa = self.components_by_type.get(SWA)
        if swa is None:
            return ["tombstone"] * len(node_ids)
        lru = self.lru_lists[SWA]
        pt, tail, members, referenced = lru._pt, lru.tail, lru.cache, lru._is_referenced
        evicting = swa.is_evict_device_ongoing or SWA in self._pending_internal_evictions
        arena, root = self._node_arena, self.root_node
        out, moves = [], []
        # Decided first (reads only), then relinked all or none (see below).
        for node_id in node_ids:
            node = arena.get(node_id)
            if node is None:
                out.append("gone")
            elif node is root:
                out.append("root")
            elif node.component_data[SWA].value is None or node_id not in members:
                out.append("tombstone")
            elif evicting:
                out.append("evicting")
            elif node.component_data[SWA].lock_ref > 0:
                out.append("locked")
            elif referenced is not None and referenced(node):
                out.append("session")
            else:
                moves.append(node)
                out.append("moved")
        done = []                   # (node, its predecessor before the move)
        try:
            for node in moves:
                prev = node.lru_prev[pt]
                lru._remove_node(node)
                try:
                    lru._add_node_after(tail.lru_prev[pt], node)
                except BaseException:
                    lru._add_node_after(prev, node)
                    raise
                done.append((node, prev))
        except BaseException:
            # Undo in reverse: each restores exactly the list its move started from, so the
            # caller's window is never left half moved.
            for node, prev in reversed(done):
                lru._remove_node(node)
                lru._add_node_after(prev, node)
            raise
        return out
