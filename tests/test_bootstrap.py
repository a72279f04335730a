"""sitecustomize.py in a real child Python, as the image runs it (PYTHONPATH=<repo root>)."""
import re

import pytest

from conftest import run_python


def _imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", line)
        if m:
            names.add(m.group(1))
    return names


def test_no_key_imports_neither_torch_nor_sglang_nor_us():
    proc = run_python("pass", args=("-X", "importtime"))
    assert proc.returncode == 0, proc.stderr
    mods = _imported_modules(proc.stderr)
    assert "sitecustomize" in mods            # ours ran ...
    assert not {m for m in mods if m.split(".")[0] in ("torch", "sglang", "adapter", "wrapt")}


def test_key_set_arms_installer_without_importing_the_engine():
    proc = run_python("import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in "
                      "('torch', 'sglang')))", env={"DSV41_SWA_THIN": "1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("env, needle", [
    ({"DSV41_DECODE_YIELD": "abc"}, "DSV41_DECODE_YIELD='abc'"),
    ({"DSV41_DECODE_YIELD": "150"}, "DSV41_DECODE_YIELD=150: out of range 1..99"),
    ({"DSV41_SWA_THIM": "1"}, "DSV41_SWA_THIM: unknown key; did you mean DSV41_SWA_THIN"),
])
def test_bad_key_stops_the_process_with_the_key_named(env, needle):
    proc = run_python("print('UNREACHED')", env=env)
    assert proc.returncode == 2
    assert "UNREACHED" not in proc.stdout
    assert "[dsv41] FATAL: configuration error" in proc.stderr
    assert needle in proc.stderr
    assert "Error in sitecustomize" not in proc.stderr      # not swallowed by site


def test_far_unknown_key_is_one_warning_line():
    proc = run_python("print('ran')", env={"DSV41_OPERATOR_SOMETHING": "7"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ran"
    warnings = [ln for ln in proc.stderr.splitlines() if "DSV41_OPERATOR_SOMETHING" in ln]
    assert len(warnings) == 1 and "unknown key" in warnings[0]


def test_broken_bootstrap_is_not_swallowed_by_site(tmp_path):
    # A package named `adapter` that fails to import shadows ours: the bootstrap itself breaks.
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "__init__.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "sitecustomize.py").write_text(
        (run_python.__globals__["REPO_ROOT"] / "sitecustomize.py").read_text())
    proc = run_python("print('UNREACHED')", env={"DSV41_SWA_THIN": "1", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 2
    assert "RuntimeError: boom" in proc.stderr and "[dsv41] FATAL" in proc.stderr
