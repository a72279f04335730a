"""Cone replay beside swa_thin and decode yield: all install through `dsv41 check`'s path, in table
order, and cone still plans its replay with thin's tree-core choice in place (child processes
armed from the environment by sitecustomize, as in production)."""
import json


from conftest import REPO_ROOT, run_python

PRODUCTION_KEYS = {"DSV41_SWA_THIN": "1", "DSV41_DECODE_YIELD": "33",
                   "DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "8192"}
NEEDED = ("swa_thin", "decode_yield", "swa_cone")


def test_table_order_thin_before_cone():
    from adapter.table import ADAPTERS, HOOKS

    assert ADAPTERS.index("swa_thin") < ADAPTERS.index("swa_cone")
    rows = [h.adapter for h in HOOKS]
    assert max(i for i, a in enumerate(rows) if a == "swa_thin") < rows.index("swa_cone")


def test_check_installs_thin_yield_and_cone_together():
    from adapter.tools import check, profile

    line = profile.line_from_text(" ".join(f"{k}={v}" for k, v in PRODUCTION_KEYS.items())
                                  + " --swa-prefix-tails 384")
    code, rows, stderr = check.run(line)
    by_name = {r["adapter"]: r for r in rows}
    for name in NEEDED:
        assert by_name[name]["installed"], (name, by_name[name]["reason"], stderr[-2000:])
        assert by_name[name]["pin_ok"] is True
    assert check.ok(code, rows), stderr[-2000:]
    for name in NEEDED:
        assert f"[dsv41] {name} installed: " in stderr


CHILD = r"""
import json, sys
from adapter import installer, receipts
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
import sglang.srt.managers.scheduler, sglang.srt.managers.schedule_policy
import sglang.srt.mem_cache.unified_radix_cache
from adapter.tools.sims import swa_cone as sim
status = {k: v.status for k, v in installer.status().items()}
r = sim.scenario(doc_tokens=20000, prompts=60, prompt_tokens=1024, tail_tokens=2048,
                 backend="rust", full_tokens=200_000, swa_tokens=16384)
print("RESULT " + json.dumps({"status": status, "run": r,
                              "core": type(sim.LAST_CACHE.tree_core).__name__,
                              "plans": receipts.counters["swa_cone"]["plans"]}))
"""


def test_cone_plans_with_thin_and_yield_installed():
    proc = run_python(CHILD, env={**PRODUCTION_KEYS, "DSV41_SWA_CONE_TOKENS": "2048"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert all(out["status"][n] == "installed" for n in NEEDED), out["status"]
    assert out["plans"] == 1
    # One chunk of replay plus the new tokens (and at most a page or two of tail) is prefilled.
    assert out["run"]["prefill_tokens"] <= 2048 + 2048 + 2 * 256
    assert out["run"]["cached_tokens"] >= out["run"]["prompt_tokens"] - 2048 - 2048 - 2 * 256
    assert "swa_cone plan request=" in proc.stderr
