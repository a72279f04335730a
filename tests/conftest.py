"""Test harness: the pinned engine on CPU, and in-process installs of adapters.

The only stand-in is adapter/cpu/cpu_engine.py's torchvision shim (PyPI's torchvision is CUDA-linked
and cannot load beside CPU torch); every engine class used here is the real one.
"""
import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from adapter.cpu import cpu_engine  # noqa: E402

cpu_engine.install_torchvision_shim()


@pytest.fixture
def install_adapters():
    """install_adapters({"DSV41_SWA_THIN": "1"}) -> installer status; undone after the test.

    Runs the production installer in this process (report mode, so a refusal is recorded rather
    than exiting pytest) and imports the engine modules of the enabled adapters.
    """
    from adapter import installer

    installer.reset_for_tests()
    yield installer.install_in_process
    installer.reset_for_tests()
    installer.set_mode("boot")


def run_python(code: str, env: dict | None = None, args=(), argv=(), timeout=300, cwd=REPO_ROOT):
    """Run a child Python with PYTHONPATH=<repo root> (as the image does) and only `env` + PATH.

    `args` go before `-c` (interpreter flags), `argv` after the code (sys.argv[1:]); `env` may
    override PYTHONPATH (e.g. to run without our sitecustomize.py).
    """
    child_env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/root"),
                 "PYTHONPATH": str(REPO_ROOT)}
    child_env.update(env or {})
    return subprocess.run([sys.executable, *args, "-c", code, *argv], env=child_env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)
