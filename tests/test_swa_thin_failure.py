"""swa_thin: a move that fails half way leaves the SWA LRU exactly as the engine had it (issue 30).

A passed checkpoint's window is two or three SWA nodes; thin relinks them one by one. A failure
on the second relink used to leave the first at the evict-first end and the rest in place (and,
on the engine's Python core, a node removed from the LRU but never re-added if the insert itself
raised). Now a window moves whole or not at all. On the real UnifiedRadixCache with thin
installed, both ways thin moves: thin's own core (`demote_swa_lru`) and the engine's Python core
(`UnifiedLRUList` relinks, OWN_CORE off).
"""
from __future__ import annotations

import pytest

from adapter import receipts


def _order(cache):
    """The SWA device LRU, head to tail, as node ids (sentinels by name), and its members."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    lru = cache.tree_core.lru_lists[ComponentType.SWA]
    pt, out, x = lru._pt, [], lru.head.lru_next[lru._pt]
    while x is not lru.tail:
        out.append("mid" if x is lru.mid else x.id)
        x = x.lru_next[pt]
    return out, set(lru.cache)


@pytest.mark.parametrize("own_core", [True, False], ids=["thin-core", "engine-python-core"])
def test_a_move_failing_on_its_second_node_is_undone(install_adapters, monkeypatch, own_core):
    import adapter.swa_thin as thin
    from adapter.tools.sims.swa_cone import Driver, build
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedLRUList

    monkeypatch.setattr(thin, "OWN_CORE", own_core)
    status = install_adapters({"DSV41_SWA_THIN": "1"})
    assert status["swa_thin"].status == "installed", status["swa_thin"].detail
    cpu = build(60_000, 16_384, "python")
    assert (type(cpu.cache.tree_core).__name__ == "ThinTreeCore") is own_core
    drv = Driver(cpu, chunk=1024)
    thin.reset_counts()

    # The relink that fails: the second one of each move (thin's core: _add_node_after, which
    # demote_swa_lru calls; the engine's core: insert_after / insert_mru after remove_node).
    state = {"on": False, "n": 0, "failed": 0, "checked": 0}
    names = ["_add_node_after"] if own_core else ["insert_after", "insert_mru"]
    for name in names:
        real = getattr(UnifiedLRUList, name)

        def failing(self, *args, _real=real, **kwargs):
            if state["on"]:
                state["n"] += 1
                if state["n"] == 2:
                    state["failed"] += 1
                    raise RuntimeError("planted in the second relink")
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(UnifiedLRUList, name, failing)

    real_move = thin.move_passed_checkpoint

    def move(cache, old_id, new_id):
        before = _order(cache)
        state.update(on=True, n=0)
        try:
            return real_move(cache, old_id, new_id)
        except RuntimeError:
            assert _order(cache) == before      # nothing moved, nothing left the LRU
            from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

            lru = cache.tree_core.lru_lists[ComponentType.SWA]
            assert all(node.id == key for key, node in lru.cache.items())   # members, not None
            state["checked"] += 1
            raise
        finally:
            state["on"] = False

    monkeypatch.setattr(thin, "move_passed_checkpoint", move)
    req, _, _ = drv.prefill(list(range(1, 6001)), output_tokens=[7] * 8)
    assert req.finished()
    assert state["failed"] >= 1 and state["checked"] == state["failed"]
    drv.cache.sanity_check()
    counts = thin.counts()
    assert counts["fallback:move failed (RuntimeError); this checkpoint keeps the engine's SWA "
                  "LRU order"] == state["failed"]
    again, prefix, _ = drv.prefill(list(range(1, 6001)) + [3] * 100)
    assert prefix >= 5888                       # the inserts stood: the prompt is cached
    drv.cache.sanity_check()
