"""The engine's own tree-core test scenarios, run on thin's core beside the engine's two cores.

The installed engine ships its unified-radix-cache test kit as fixtures
(`sglang.test.kits.unified_radix_cache`): `build_fixture(cfg)` builds a real UnifiedRadixCache on
the backend named by `fixtures.TREE_CORE_TEST_BACKEND`, and the fixture mixins carry the
scenarios (`SegmentLockFuzzFixtures._run_seed`, `SegmentLockProtocolFixtures`,
`ResumableInsertWalkSWAFixtures`). The test functions around them are ours; every SWA config of
the kit's `config.CONFIGS` (Full + SWA at pages 1 to 128 and windows 2 to 128, and Full + SWA +
Mamba) runs on the engine's Python core, its Rust core and thin's core ("dsv41_thin").

What the harness supplies (test-only, nothing in the engine is changed):
- `sglang.test.test_utils` (imported by the kit's config) imports `datasets` (Hugging Face), not
  installed here: a stand-in module whose `load_dataset` raises, only when it is missing, and
  only while the kit imports.
- `fixtures.get_device` answers "cpu" (the kit asks for an accelerator).
- thin's core with the kit's white-box reads: `UnifiedTreeCoreInspector`'s methods on
  ThinTreeCore, registered for the test under "dsv41_thin".
- The kit's Rust inspector needs the inspection build of the Rust extension
  (`mem_cache_inspection`), which the sglang wheel does not ship: the Rust core runs behind a
  stand-in that answers what the public binding can (parent, key length, node presence) and
  raises NotImplementedError for the rest (lock refs, children). On Rust the protocol scenario
  checks the rejection only (as the kit itself does there); the tombstone and barrier scenarios
  need children and compare thin with the Python core, so they are not parametrized on Rust.
"""
from __future__ import annotations

import importlib.util
import sys
import types
import unittest
from unittest import mock

import pytest

BACKENDS = ("python", "rust", "dsv41_thin")
RUST_INSPECTOR = "sglang.test.kits.unified_radix_cache.rust_unified_tree_core_inspector"
NO_RUST_INSPECTION = ("needs the Rust inspection build (mem_cache_inspection), which the sglang "
                      "wheel does not ship")


def _import_kit():
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    stand_in = None
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stand_in = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise RuntimeError("datasets is not installed (dsv41 test stand-in)")

        stand_in.load_dataset = load_dataset
        sys.modules["datasets"] = stand_in
    try:
        from sglang.test.kits.unified_radix_cache import config, fixtures, insert_walk
    finally:
        if stand_in is not None:           # only the kit's import chain sees it
            sys.modules.pop("datasets", None)
    return config, fixtures, insert_walk


config, fixtures, insert_walk = _import_kit()
# The Full + SWA configs (what thin's core serves). The kit's Full + SWA + Mamba configs do not
# run here on any core: its `_make_req` gets no Mamba slot from this CPU build's pool.
SWA_CONFIGS = [c for c in config.CONFIGS if c.has_swa and not c.has_mamba]
# Each scenario on the configs that meet its own preconditions:
# - the fuzz trims a random, unaligned SWA prefix per insert: page size 1 (larger pages assert a
#   page-aligned evicted length in the SWA component);
FUZZ_CONFIGS = [c for c in SWA_CONFIGS if c.page_size == 1]
# - the protocol scenario inserts 2 x window pages: they must fit the config's KV pool;
PROTOCOL_CONFIGS = [c for c in SWA_CONFIGS if 2 * c.sliding_window_size * c.page_size <= c.kv_size]
# - the tombstone scenario inserts one window of tokens: at least one page.
WINDOW_CONFIGS = [c for c in SWA_CONFIGS if c.sliding_window_size % c.page_size == 0]


def _rust_public_inspector():
    """RustUnifiedTreeCore behind the kit's inspection interface, from public bindings only."""
    from sglang.srt.mem_cache.rust_tree_core.adapter import RustUnifiedTreeCore
    from sglang.test.kits.unified_radix_cache.unified_tree_core_inspection_interface import (
        UnifiedTreeCoreInspectionInterface as Inspection,
    )

    def unavailable(name):
        def method(self, *args, **kwargs):
            raise NotImplementedError(f"{name} {NO_RUST_INSPECTION}")
        return method

    def last(self, node_id):
        path = self.collect_path_info([node_id])[0]
        return path[-1] if path else None

    def contains_node(self, node_id):
        try:
            self.collect_path_info([node_id])
        except KeyError:
            return False
        return True

    def get_parent_node_id(self, node_id):
        info = last(self, node_id)
        return None if info is None else info.parent_id

    def get_node_key_length(self, node_id):
        info = last(self, node_id)
        return 0 if info is None else info.path_end - info.path_start

    def implemented(name):
        attr = getattr(RustUnifiedTreeCore, name, None)
        return attr is not None and not getattr(attr, "__isabstractmethod__", False)

    ns = {name: unavailable(name) for name in Inspection.__abstractmethods__ if not implemented(name)}
    ns.update(contains_node=contains_node, get_parent_node_id=get_parent_node_id,
              get_node_key_length=get_node_key_length)
    return type("RustPublicInspector", (RustUnifiedTreeCore, Inspection), ns)


def _thin_inspector():
    from adapter.swa_thin.core import ThinTreeCore
    from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import UnifiedTreeCoreInspector

    return type("ThinTreeCoreInspector", (UnifiedTreeCoreInspector, ThinTreeCore), {})


@pytest.fixture
def backend_kit(request, monkeypatch):
    """Point the kit's build_fixture at `backend` (parametrized as `backend`)."""
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import _TREE_CORE_REGISTRY

    backend = request.param
    monkeypatch.setattr(fixtures, "get_device", lambda *args: "cpu")
    monkeypatch.setattr(fixtures, "TREE_CORE_TEST_BACKEND", backend)
    if backend == "rust":
        stand_in = types.ModuleType(RUST_INSPECTOR)
        stand_in.RustUnifiedTreeCoreInspector = _rust_public_inspector()
        monkeypatch.setitem(sys.modules, RUST_INSPECTOR, stand_in)
    thin = _thin_inspector()
    with mock.patch.dict(_TREE_CORE_REGISTRY, {"dsv41_thin": lambda params, comps: thin(params, comps)}):
        yield backend


def _case(mixin, cfg):
    """A unittest case binding the kit's mixin to `cfg` (its scenarios use self.assert*)."""
    cls = type(f"{mixin.__name__}_{cfg.label}", (mixin, unittest.TestCase),
               {"cfg": cfg, "runTest": lambda self: None})
    return cls()


def _core_name(cache) -> str:
    return type(cache.tree_core).__name__


EXPECTED_CORE = {"python": "UnifiedTreeCoreInspector", "rust": "RustPublicInspector",
                 "dsv41_thin": "ThinTreeCoreInspector"}
both = pytest.mark.parametrize("backend_kit", BACKENDS, indirect=True)


def cfgs_of(configs):
    return pytest.mark.parametrize("cfg", configs, ids=[c.label for c in configs])


@both
@cfgs_of(FUZZ_CONFIGS)
def test_segment_lock_fuzz(backend_kit, cfg):
    """The kit's random insert / match / lock / unlock / release_swa / evict walk, sanity-checked
    after every step, four seeds of 120 steps per config."""
    case = _case(insert_walk.SegmentLockFuzzFixtures, cfg)
    built = []
    real = fixtures.build_fixture

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        built.append(_core_name(out[0]))
        return out

    with mock.patch.object(insert_walk, "build_fixture", spy):
        for seed in range(4):
            case._run_seed(seed)
    assert built == [EXPECTED_CORE[backend_kit]] * 4


@both
@cfgs_of(PROTOCOL_CONFIGS)
@pytest.mark.parametrize("release", ["dec_lock_ref", "dec_swa_lock_only"])
def test_segment_lock_protocol_rejects_an_unanchored_release(backend_kit, cfg, release):
    """A receipt released on another node fails before any lock count or free list changes;
    the right release then leaves a sane tree.

    On Rust the lock counts are not readable (they need the Rust inspection build,
    mem_cache_inspection, which the sglang wheel does not ship), and the kit itself checks only
    the rejection there (a Rust panic poisons the core: the crate's own tests check its state):
    so Rust runs the rejection alone, from public bindings."""
    case = _case(insert_walk.SegmentLockProtocolFixtures, cfg)
    cache, allocator, leaf = case._leaf_with_lock_path()
    assert _core_name(cache) == EXPECTED_CORE[backend_kit]
    receipt = cache.inc_lock_ref(leaf)
    params = receipt.to_dec_params()
    other = fixtures.node_parent(cache, leaf)
    if release == "dec_lock_ref":
        wrong = lambda: cache.dec_lock_ref(other, params)   # noqa: E731
    else:
        wrong = lambda: cache.tree_core.dec_swa_lock_only(other, params)   # noqa: E731
    if backend_kit == "rust":
        case._assert_protocol_violation(wrong, "lock receipt anchored on node")
        return
    case._assert_unanchored_release_rejected(cache, allocator, leaf, wrong,
                                             lambda: cache.dec_lock_ref(leaf, params))


def _recover(backend, cfg, lock_full, monkeypatch):
    monkeypatch.setattr(fixtures, "TREE_CORE_TEST_BACKEND", backend)
    case = _case(insert_walk.ResumableInsertWalkSWAFixtures, cfg)
    result, n = case._recover_swa_tombstone_with_tracking(lock_full=lock_full)
    return result.prefix_len, result.adopted_ranges, n


@pytest.mark.parametrize("backend_kit", ["dsv41_thin"], indirect=True)
@cfgs_of(WINDOW_CONFIGS)
@pytest.mark.parametrize("lock_full", [False, True], ids=["unlocked", "full-locked"])
def test_resumable_insert_walk_recovers_a_swa_tombstone_as_the_python_core(backend_kit, cfg, lock_full,
                                                                             monkeypatch):
    """The kit's insert over an SWA tombstone (Full locked or not), with adopted ranges tracked:
    thin's core answers what the engine's Python core answers (Rust: children are not readable
    from the public binding, which this scenario needs)."""
    thin = _recover("dsv41_thin", cfg, lock_full, monkeypatch)
    python = _recover("python", cfg, lock_full, monkeypatch)
    assert thin == python
    assert thin[0] == thin[2]            # the whole key matched the recovered leaf


@pytest.mark.parametrize("backend_kit", ["dsv41_thin"], indirect=True)
@cfgs_of(WINDOW_CONFIGS)
def test_insert_walk_steps_through_barriers_as_the_python_core(backend_kit, cfg, monkeypatch):
    """An insert over a path of SWA tombstones (two earlier inserts whose SWA was evicted) stops
    at barriers inside the walk; stepped with the kit's `advance_insert_walk_once` (one walked node
    at a time) and resumed, thin's offset walk stops at the same offsets and phases, ends on the
    same node with the same result and tree as the engine's sliced walk."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    def walk(backend):
        monkeypatch.setattr(fixtures, "TREE_CORE_TEST_BACKEND", backend)
        case = _case(insert_walk.ResumableInsertWalkSWAFixtures, cfg)
        cache, allocator, _ = fixtures.build_fixture(cfg)
        pages = max(1, cfg.sliding_window_size // cfg.page_size)
        a = case._make_seq(1, pages)
        b = case._make_seq(1000, pages)
        for seq in (a, a + b):                      # two nodes, SWA evicted on both
            value = case._alloc(allocator, len(seq))
            allocator.free_swa(value)
            cache.insert(InsertParams(key=RadixKey(array("q", seq)), value=value,
                                      component_evicted_seqlens={ComponentType.SWA: len(seq)}))
        seq = a + b + case._make_seq(5000, pages)
        core = cache.tree_core
        step = core.begin_insert(InsertParams(key=RadixKey(array("q", seq)),
                                              value=case._alloc(allocator, len(seq))))
        stops = []
        while step.result is None:
            cache._apply_cache_actions(step.actions)
            state = core._ongoing_insert_walk_state
            stops.append((state.phase.name, state.total_prefix_length))
            if state.phase.name == "WALK":
                core.advance_insert_walk_once()      # one node; its actions stay pending
                state = core._ongoing_insert_walk_state
                stops.append(("stepped", state.total_prefix_length))
            step = core.resume_insert()
        cache._apply_cache_actions(step.actions)
        cache._apply_cache_actions(core.end_insert())
        cache.sanity_check()
        result = step.result
        path = case._path_chain(cache, result.last_device_node)
        return (result.prefix_len, stops, [fixtures.node_key_length(cache, n) for n in path],
                [fixtures.node_device_value(cache, n, ComponentType.SWA) is not None for n in path])

    thin, python = walk("dsv41_thin"), walk("python")
    assert thin == python
    assert any(phase == "WALK" for phase, _ in thin[1]), thin[1]   # it did stop inside the walk
