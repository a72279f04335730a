"""The installer: table, pins, refusal on drift, both entry paths, exactly-once installs."""
import importlib.metadata
import importlib.util

import pytest

from adapter import pins
from adapter.table import ADAPTERS, HOOKS, hooks_of, install_groups
from conftest import run_forked, run_python


def test_table_rows_are_unique_and_every_adapter_has_a_module():
    assert len({(h.adapter, h.target) for h in HOOKS}) == len(HOOKS)
    for name in ADAPTERS:
        assert importlib.util.find_spec(f"adapter.{name}") is not None, name


def test_groups_join_adapters_that_share_a_callable_in_table_order():
    groups = install_groups(ADAPTERS)
    assert sorted(a for g in groups for a in g) == sorted(ADAPTERS)
    for g in groups:
        assert list(g) == sorted(g, key=ADAPTERS.index)
    for a in ADAPTERS:
        for b in ADAPTERS:
            shared = {h.target for h in hooks_of(a)} & {h.target for h in hooks_of(b)}
            if shared:
                assert any(a in g and b in g for g in groups), (a, b, shared)


def test_pins_file_covers_exactly_the_table_and_matches_the_pinned_engine():
    pinned = pins.load()
    assert set(pinned) == {h.pin_id for h in HOOKS}
    assert pins.current() == pinned


def test_plugin_entry_point_is_registered():
    eps = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert {ep.name: ep.value for ep in eps}.get("dsv41") == "adapter.plugin:load"


DRIFT_CHILD = r"""
import importlib, sys
from adapter import installer
from adapter.cpu import cpu_engine
from adapter.table import hooks_of
cpu_engine.install_torchvision_shim()
row = hooks_of(sys.argv[1])[0]
# the engine changed this callable (one added statement)
sha = cpu_engine.drift_callable(importlib.import_module(row.module), row.qualname)
print("ALTERED", sha, flush=True)
installer.bootstrap(environ={k: "33" if k == "DSV41_DECODE_YIELD" else "1" for k in sys.argv[2:]})
print("UNREACHED", flush=True)
"""


# The engine modules every drift case imports, once per fork driver (conftest.run_forked): each
# case is then its own child (its own boot stopped with exit 3), without paying the imports again.
DRIFT_PRELOAD = """
import importlib
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter import installer, pins
from adapter.table import ADAPTERS, hooks_of
for name in ADAPTERS:
    for row in hooks_of(name):
        importlib.import_module(row.module)
"""
DRIFTED = [("decode_yield", "DSV41_DECODE_YIELD"), ("swa_thin", "DSV41_SWA_THIN"),
           ("admin_guard", "DSV41_ADMIN_GUARD")]


@pytest.fixture(scope="module")
def drifted_boots(tmp_path_factory):
    """{(adapter, key): the child's CompletedProcess} for every DRIFTED case, run once."""
    runs = run_forked(DRIFT_CHILD, DRIFTED, DRIFT_PRELOAD, tmp_path_factory.mktemp("drift"))
    return dict(zip(DRIFTED, runs))


@pytest.mark.parametrize("adapter, key", DRIFTED)
def test_drifted_callable_refuses_and_stops_the_boot(drifted_boots, adapter, key):
    proc = drifted_boots[(adapter, key)]
    assert "ALTERED" in proc.stdout and "UNREACHED" not in proc.stdout
    assert proc.returncode == 3, proc.stderr[-2000:]
    row = hooks_of(adapter)[0]
    found = proc.stdout.split("ALTERED ")[1].split()[0]
    fatal = [ln for ln in proc.stderr.splitlines() if "FATAL" in ln]
    assert len(fatal) == 1, proc.stderr[-2000:]
    msg = fatal[0]
    assert f"{adapter} refused to install" in msg
    assert row.pin_id in msg and pins.load()[row.pin_id] in msg and found in msg
    assert f"Unset {key}" in msg


ONCE_CHILD = r"""
import importlib, sys
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter.table import hooks_of
from adapter import pins
name = sys.argv[1]
for row in hooks_of(name):
    importlib.import_module(row.module)         # a plain engine import installs the adapter
from sglang.srt.plugins import load_plugins
load_plugins()                                  # the engine's own plugin path: finds it done
from adapter import plugin
plugin.load()
depth = {}
for row in hooks_of(name):
    fn = pins.resolve(row)[2]
    fn = getattr(fn, "__func__", fn)
    n = 0   # HookRegistry wrappers in the chain (the engine's own decorators don't count)
    while hasattr(fn, "__wrapped__"):
        n += fn.__code__.co_qualname.startswith("_wrap_fn.")
        fn = fn.__wrapped__
    depth[row.target] = n
print("DEPTH", depth)
"""


@pytest.mark.parametrize("adapter, env", [
    ("swa_thin", {"DSV41_SWA_THIN": "1"}),
    ("decode_yield", {"DSV41_DECODE_YIELD": "33"}),
    ("admin_guard", {"DSV41_ADMIN_GUARD": "1"}),
])
def test_sitecustomize_and_plugin_install_exactly_once(adapter, env):
    proc = run_python(ONCE_CHILD, env=env, argv=(adapter,))
    assert proc.returncode == 0, proc.stderr[-3000:]
    receipts = [ln for ln in proc.stderr.splitlines() if f"[dsv41] {adapter} installed:" in ln]
    assert len(receipts) == 1, proc.stderr[-3000:]
    depth = eval(proc.stdout.split("DEPTH ")[1])
    assert depth and all(d == 1 for d in depth.values()), depth


def test_plugin_path_alone_installs(tmp_path):
    """Without our sitecustomize on the path, the engine's load_plugins() installs the adapter."""
    code = ("import sys; from adapter.cpu import cpu_engine; cpu_engine.install_torchvision_shim()\n"
            "import sglang.srt.managers.scheduler as s\n"
            "assert not hasattr(sys.modules.get('sitecustomize'), 'installer')\n"
            "from sglang.srt.plugins import load_plugins; load_plugins()\n"
            "print('WRAPPED', hasattr(s.Scheduler.get_next_batch_to_run, '__wrapped__'))\n")
    # PYTHONPATH without the repo root: our sitecustomize.py is not found, the package is
    # importable through its (editable) install, as a pip-installed plugin would be.
    proc = run_python(code, env={"DSV41_DECODE_YIELD": "33", "PYTHONPATH": str(tmp_path)},
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "WRAPPED True" in proc.stdout
    assert sum("[dsv41] decode_yield installed:" in ln for ln in proc.stderr.splitlines()) == 1


def test_repeated_installs_in_one_process_apply_every_time(install_adapters):
    """reset_for_tests() must leave HookRegistry as it found it: install, undo, install again."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    for environ in ({"DSV41_SWA_THIN": "1"}, {"DSV41_SWA_CONE_REPLAY": "1"},
                    {"DSV41_SWA_THIN": "1", "DSV41_SWA_CONE_REPLAY": "1"}, {}):
        status = install_adapters(environ)
        on = {n for n, s in status.items() if s.status != "off"}
        assert all(status[n].status == "installed" for n in on), {n: status[n].detail for n in on}
        for name in on:
            for row in hooks_of(name):
                fn = pins.resolve(row)[2]
                assert hasattr(getattr(fn, "__func__", fn), "__wrapped__"), row.target
    from adapter import installer
    installer.reset_for_tests()
    ours = [t for t, hooks in HookRegistry._hooks.items()
            if any(h[2] and h[2].dist_name == installer.PLUGIN_NAME for h in hooks)]
    assert ours == [] and not any(h == [] for h in HookRegistry._hooks.values())


TOUCH_DRIFT_CHILD = r"""
import importlib, sys
from adapter import installer
from adapter.cpu import cpu_engine
from adapter.table import hooks_of
cpu_engine.install_torchvision_shim()
adapter, key, touched = sys.argv[1:4]
module_name, _, qualname = touched.partition(":")
module = importlib.import_module(module_name)
if qualname.count(".") == 0 and not callable(getattr(module, qualname)):
    delattr(module, qualname)                   # the engine dropped this module attribute
    print("ALTERED missing", flush=True)
else:                                           # the engine changed this callable's source
    print("ALTERED", cpu_engine.drift_callable(module, qualname), flush=True)
installer.bootstrap(environ={key: "33" if key == "DSV41_DECODE_YIELD" else "1"})
for row in hooks_of(adapter):
    importlib.import_module(row.module)
print("UNREACHED", flush=True)
"""


TOUCHED = [
    ("swan", "DSV41_SWA_NATIVE_DECODE", "sglang.kernels.ops.attention.flash_mla_sm120:_split_kv_pages_to_64"),
    ("decode_yield", "DSV41_DECODE_YIELD", "sglang.srt.managers.schedule_batch:ScheduleBatch.batch_size"),
    ("swa_thin", "DSV41_SWA_THIN", "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedLRUList.insert_after"),
    ("swa_cone", "DSV41_SWA_CONE_REPLAY", "sglang.srt.layers.attention.attention_registry:_is_hip"),
    ("autotune_keep", "DSV41_AUTOTUNE_KEEP",
     "sglang.srt.model_executor.runner.flashinfer_autotune:_autotune_tactic_sync_group"),
]


@pytest.fixture(scope="module")
def touch_drifted_boots(tmp_path_factory):
    """{(adapter, key, touched): the child's CompletedProcess} for every TOUCHED case, run once."""
    runs = run_forked(TOUCH_DRIFT_CHILD, TOUCHED, DRIFT_PRELOAD, tmp_path_factory.mktemp("touch-drift"))
    return dict(zip(TOUCHED, runs))


@pytest.mark.parametrize("adapter, key, touched", TOUCHED)
def test_drift_in_a_touched_internal_refuses_naming_the_key(touch_drifted_boots, adapter, key, touched):
    """Not wrapped, only read or called: drift there stops the boot exactly as a wrapped one does."""
    assert touched in pins.touches_of(adapter)
    proc = touch_drifted_boots[(adapter, key, touched)]
    assert "ALTERED" in proc.stdout and "UNREACHED" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == 3, proc.stderr[-2000:]
    found = proc.stdout.split("ALTERED ")[1].split()[0]
    [fatal] = [ln for ln in proc.stderr.splitlines() if "FATAL" in ln]
    assert f"{adapter} refused to install: engine internal {touched}" in fatal
    assert f"expected {pins.load_touches()[touched]}, found {found}" in fatal and f"Unset {key}" in fatal


def test_every_touched_internal_is_pinned_and_matches_the_engine():
    touched = pins.all_touches()
    assert len(touched) >= 80 and set(pins.load_touches()) == set(touched)
    assert {t: pins.fingerprint(t) for t in touched} == pins.load_touches()
    for name in ADAPTERS:
        assert pins.touches_of(name), f"{name} declares no touched internals"
