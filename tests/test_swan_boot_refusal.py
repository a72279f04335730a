"""A boot that swan refuses says why in every harness report: the CPU server's BootError, `dsv41
canary` and `dsv41 gate boot` show the refusal line (key to unset, cause) first, then the other
error lines, not a headline with an empty tail.

One short failing boot (seconds): the harness's CpuServer with the production line's DSV41 keys
and SWAN_RUNTIME_DIR at an empty directory runs a stand-in launcher instead of
`sglang.launch_server` (whose tokenizer manager alone takes ~30 s to start here): a process that
starts one child importing the engine's SM12x decode module, as the engine's scheduler does on
the cluster, and raises when the child dies, as the engine's launcher does when its scheduler
dies during initialisation. Both processes run the production install path (our sitecustomize
through the harness's, per-process logs); the refusal happens in the child, at that import.
"""
import pathlib
import sys

import pytest

from adapter.cpu.server import BootError, CpuServer, error_lines
from adapter.tools import canary, cli

PROFILE = str(pathlib.Path(__file__).resolve().parent.parent / ".env.tp4.example")
ENGINE_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
LAUNCHER = (
    "import subprocess, sys\n"
    f"child = subprocess.run([sys.executable, '-c', 'import {ENGINE_MODULE}'])\n"
    "if child.returncode:\n"
    "    raise RuntimeError(f'Rank 0 scheduler died during initialization (exit code: {child.returncode})')\n"
)


class StandInLauncher(CpuServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", LAUNCHER]


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
    """The BootError of a production-line boot whose swan module is missing."""
    line, = canary.load_checked_lines(PROFILE, "production")
    keys, _, _ = canary.split_line(line)
    assert keys.get("DSV41_SWA_NATIVE_DECODE") == "1"
    empty = tmp_path_factory.mktemp("no-swan-module")
    server = StandInLauncher("dense", keys=keys, name="swan-refused",
                             log_dir=tmp_path_factory.mktemp("logs"),
                             extra_env={"SWAN_RUNTIME_DIR": str(empty)})
    with pytest.raises(BootError) as info:
        server.start(timeout=120)
    assert server.group_alive() == []
    return info.value


def test_boot_error_leads_with_the_refusal(refused):
    first = str(refused).splitlines()[0]
    assert first.startswith("server swan-refused exited with code 1 during boot: [dsv41] FATAL: ")
    assert "swan refused to install: the swan256 module is not built" in first
    assert "Unset DSV41_SWA_NATIVE_DECODE to boot without swan" in first
    # every error line, the refusal first, each named by its process; then the launcher's own
    assert "] [dsv41] FATAL: swan refused to install" in refused.errors[0]
    assert refused.errors[-1].startswith("[launcher (HTTP + tokenizer manager) pid ")
    assert refused.errors[-1].endswith("RuntimeError: Rank 0 scheduler died during initialization "
                                       "(exit code: 3)")
    text = str(refused)
    assert "log tail:" in text and f"logs: {refused.server.log_dir}" in text


def test_canary_reports_the_refusal(refused, monkeypatch):
    def fail(self, *args, **kwargs):
        raise refused

    monkeypatch.setattr(CpuServer, "start", fail)
    run = canary.run_config("dense", {"DSV41_SWA_NATIVE_DECODE": "1"}, {}, scenarios=())
    assert run.errors and run.errors[0].startswith("boot failed: server swan-refused exited with code 1")
    lines = run.errors[0].splitlines()
    assert "Unset DSV41_SWA_NATIVE_DECODE" in lines[0] and "module is not built" in lines[0]
    assert any("[dsv41] FATAL: swan refused to install" in ln for ln in lines[1:])
    assert lines[-1].strip() == f"logs: {refused.server.log_dir}"


def test_gate_boot_reports_the_refusal(refused, monkeypatch, tmp_path, capsys):
    def fail(self, *args, **kwargs):
        raise refused

    monkeypatch.setattr(CpuServer, "start", fail)
    code = cli.main(["gate", "boot", "--profile", PROFILE, "--against", "production",
                     "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 3            # exits.REFUSED
    said = err[err.index("dsv41 gate boot: "):].splitlines()
    assert "swan refused to install: the swan256 module is not built" in said[0]
    assert "Unset DSV41_SWA_NATIVE_DECODE" in said[0]


def test_error_lines_order_and_engine_prefix():
    logs = {
        "launcher pid 1": "booting\nTraceback (most recent call last):\n  File \"x\", line 1\n"
                          "    raise EOFError\nEOFError\n\nDuring handling\n\n"
                          "Traceback (most recent call last):\n  File \"y\", line 2\n"
                          "RuntimeError: scheduler died\n",
        "sglang::scheduler_TP0 pid 2": "[2026-12-04 15:42:23] [dsv41] FATAL: swan refused to install: why."
                                       " Unset DSV41_SWA_NATIVE_DECODE to boot without swan.\n",
        "quiet pid 3": "nothing wrong\n",
    }
    assert error_lines(logs) == [
        "[sglang::scheduler_TP0 pid 2] [dsv41] FATAL: swan refused to install: why. "
        "Unset DSV41_SWA_NATIVE_DECODE to boot without swan.",
        "[launcher pid 1] RuntimeError: scheduler died",
    ]
