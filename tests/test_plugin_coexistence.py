"""Another SGLang plugin hooking one of our callables keeps its hook, loaded before or after ours.

The engine's HookRegistry.apply_hooks() skips a target it has already patched, so without the
installer's guard a hook registered after ours is silently never applied, and one applied before
our install hides ours. Each test builds a second plugin as its own distribution (a package and a
dist-info with a `sglang.srt.plugins` entry point, on the child's path) that wraps
`select_tree_core_backend` (a swa_thin row) and records whether our hook ran inside it, and runs
the engine's own load_plugins() in a child with DSV41_SWA_THIN=1 (sitecustomize installs ours).

Documented order (docs/installer.md, README "How it installs"): hooks on one callable nest in
registration order, the first registered innermost. A plugin loaded after ours wraps ours (its
hook runs first); one loaded before ours runs inside ours.
"""
import textwrap

import pytest
from conftest import REPO_ROOT, run_python

TARGET = "sglang.srt.mem_cache.unified_cache.tree_core_registry.select_tree_core_backend"

PLUGIN = f'''
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

EVENTS = []


def hook(original, params, *args, **kwargs):
    from adapter import receipts
    before = receipts.counters["swa_thin"]["core:python"]
    EVENTS.append("other:enter")
    name = original(params, *args, **kwargs)
    ran_inside = receipts.counters["swa_thin"]["core:python"] > before
    EVENTS.append("other:exit (ours ran inside)" if ran_inside else "other:exit")
    return name


def load():
    HookRegistry.register("{TARGET}", hook, HookType.AROUND)
'''

CHILD = r"""
import sys, types
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter import receipts
order = sys.argv[1]
if order == "after":        # ours installs at the engine module's import, the plugin loads later
    import sglang.srt.mem_cache.unified_cache.tree_core_registry
from sglang.srt.plugins import load_plugins
load_plugins()              # SGLANG_PLUGINS=otherplug: only the other plugin is loaded here
import otherplug
from sglang.srt.mem_cache.unified_cache import tree_core_registry as reg
params = types.SimpleNamespace(tree_core_backend="python", tree_components=())
before = receipts.counters["swa_thin"]["core:python"]
print("RESULT", reg.select_tree_core_backend(params))
print("OURS_RAN", receipts.counters["swa_thin"]["core:python"] - before)
print("EVENTS", otherplug.EVENTS)
"""


def _plugin_dist(root):
    pkg = root / "otherplug"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "otherplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sglang.srt.plugins]\notherplug = otherplug:load\n")
    return root


@pytest.mark.parametrize("order, events", [
    ("after", ["other:enter", "other:exit (ours ran inside)"]),   # theirs wraps ours
    ("before", ["other:enter", "other:exit"]),                    # ours wraps theirs
])
def test_both_hooks_run_in_registration_order(tmp_path, order, events):
    _plugin_dist(tmp_path)
    proc = run_python(CHILD, argv=(order,), timeout=600, env={
        "DSV41_SWA_THIN": "1", "SGLANG_PLUGINS": "otherplug",
        "PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "RESULT python" in out and "OURS_RAN 1" in out, out + proc.stderr[-3000:]
    assert f"EVENTS {events}" in out, out
    shares = [ln for ln in proc.stderr.splitlines() if "[dsv41] swa_thin shares select_tree_core_backend" in ln]
    assert len(shares) == 1, proc.stderr[-3000:]
    where = "outside ours (registered after dsv41)" if order == "after" else "inside ours (registered before dsv41)"
    assert "with plugin=otherplug, dist=otherplug: its AROUND hook runs " + where in shares[0]
    assert sum("[dsv41] swa_thin installed:" in ln for ln in proc.stderr.splitlines()) == 1


def test_without_the_guard_the_later_plugin_is_dropped(tmp_path):
    """Negative control: the engine's apply_hooks() as shipped skips the target we patched."""
    _plugin_dist(tmp_path)
    code = CHILD.replace("load_plugins()              #",
                         "from adapter import installer\n"
                         "HR = sys.modules['sglang.srt.plugins.hook_registry'].HookRegistry\n"
                         "HR.apply_hooks = classmethod(installer._engine_apply_hooks)\n"
                         "load_plugins()              #")
    proc = run_python(code, argv=("after",), timeout=600, env={
        "DSV41_SWA_THIN": "1", "SGLANG_PLUGINS": "otherplug",
        "PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OURS_RAN 1" in proc.stdout and "EVENTS []" in proc.stdout, proc.stdout
