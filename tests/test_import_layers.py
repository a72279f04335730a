"""The package's floors are a contract a tool checks (issue 42): import-linter's contracts in
pyproject.toml, run by the README's test command (scripts/test.sh -> scripts/lint_imports.sh);
docs/installer.md describes the same floors."""
import shutil
import subprocess
import tomllib

import pytest

from conftest import REPO_ROOT


def _contracts():
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_package"] == "adapter"
    return config["contracts"]


def test_a_layers_contract_puts_the_tools_on_top_and_the_shared_core_at_the_bottom():
    layers = [c for c in _contracts() if c["type"] == "layers"]
    assert len(layers) == 1
    floors = layers[0]["layers"]
    assert floors[0] == "tools" and floors[1] == "cpu"
    assert set(floors[-1].replace(" ", "").split("|")) == {"table", "keys", "receipts", "refusal", "locations"}
    adapters = next(f for f in floors if "swa_thin" in f)
    assert "|" in adapters                                  # independent: no adapter imports another


def test_forbidden_contracts_keep_the_tools_and_the_cpu_harness_out_of_the_production_line():
    forbidden = [c for c in _contracts() if c["type"] == "forbidden"]
    sources = {m for c in forbidden if {"adapter.tools", "adapter.cpu"} <= set(c["forbidden_modules"])
               for m in c["source_modules"]}
    assert {"adapter.plugin", "adapter.installer", "adapter.swa_thin", "adapter.admin_guard"} <= sources
    assert any(c["type"] == "acyclic_siblings" for c in _contracts())


def test_the_test_command_runs_lint_imports_before_the_tests():
    script = (REPO_ROOT / "scripts/test.sh").read_text()
    assert script.index("scripts/lint_imports.sh") < script.index("unit()")


def test_lint_imports_keeps_every_contract():
    tool = REPO_ROOT / ".venv/bin/lint-imports"
    if not tool.exists() and shutil.which("lint-imports") is None:
        pytest.skip("lint-imports not installed (requirements/cpu.lock)")
    proc = subprocess.run(["scripts/lint_imports.sh"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout
