"""One meaning for PYTHON (issue 30.6).

scripts/setup.sh reads PYTHON as the base interpreter that creates .venv; every other script
reads it as the interpreter that runs everything. setup.sh must hand .venv's interpreter to the
module build explicitly, or `PYTHON=python3.11 scripts/setup.sh` builds with python3.11 (no
nvcc wheel there: "[swan] no CUDA compiler") and setup fails. .ci/run likewise runs the image
scripts with .venv's interpreter whatever PYTHON it was given.

The real scripts run in a copy of the repo's scripts/ with stand-in interpreters that record
what they are asked to run (no pip, no compile): only which interpreter runs each step is under
test, so each test takes well under a second.
"""
import os
import shutil
import subprocess

from conftest import REPO_ROOT

PATH_WITHOUT_NVCC = "/usr/bin:/bin"

# The base interpreter a newcomer names (PYTHON=python3.11): it may only create .venv. Asked to
# run anything else it fails as a python3 without the pinned nvcc wheels does.
BASE = """#!/bin/bash
echo "base $*" >> "$CALLS"
if [ "$*" = "-m venv .venv" ]; then
    mkdir -p .venv/bin && cp "$VENV_STUB" .venv/bin/python && chmod +x .venv/bin/python
    exit 0
fi
echo "[swan] no CUDA compiler: CUDA_HOME is unset, $0 has no nvidia-cuda-nvcc toolkit" >&2
exit 1
"""

# .venv's interpreter: records each step; `-` reads its script from stdin (the verify step).
VENV = """#!/bin/bash
echo "venv $*" >> "$CALLS"
[ "$1" = "-" ] && cat > /dev/null
[ "$1" = "-c" ] && echo "sglang 0.5.23 torch stub"
exit 0
"""


def _stub(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _clone(tmp_path, *files):
    root = tmp_path / "clone"
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, root / name)
    return root


def _env(tmp_path, **extra):
    assert shutil.which("nvcc", path=PATH_WITHOUT_NVCC) is None
    return {"PATH": PATH_WITHOUT_NVCC, "HOME": str(tmp_path), "CALLS": str(tmp_path / "calls"),
            **extra}


def _calls(tmp_path):
    return (tmp_path / "calls").read_text().splitlines()


def test_setup_builds_the_module_with_the_venvs_interpreter(tmp_path):
    """A fresh clone, PYTHON naming another interpreter, no nvcc on PATH: that interpreter only
    creates .venv; the module build and its verification run with .venv/bin/python."""
    root = _clone(tmp_path, "scripts/setup.sh", "scripts/build_swan.sh")
    base = _stub(tmp_path / "bin" / "python3.11", BASE)
    venv_stub = _stub(tmp_path / "venv-python", VENV)
    proc = subprocess.run([str(root / "scripts/setup.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60,
                          env=_env(tmp_path, PYTHON=str(base), VENV_STUB=str(venv_stub)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _calls(tmp_path)
    assert [c for c in calls if c.startswith("base ")] == ["base -m venv .venv"]
    assert "venv runtime/swan256/build.py" in calls           # the build
    assert "venv -" in calls                                  # its verification (stdin script)
    assert "[setup] .venv ready: sglang 0.5.23 torch stub" in proc.stdout

    # re-run on the existing .venv: PYTHON is not used at all
    os.remove(tmp_path / "calls")
    proc = subprocess.run([str(root / "scripts/setup.sh")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60,
                          env=_env(tmp_path, PYTHON=str(base), VENV_STUB=str(venv_stub)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [c for c in _calls(tmp_path) if c.startswith("base ")]
    assert "venv runtime/swan256/build.py" in _calls(tmp_path)


def test_ci_runs_the_image_scripts_with_the_venvs_interpreter(tmp_path):
    """.ci/run given PYTHON: setup gets it (the base interpreter); every script after setup gets
    .venv/bin/python."""
    root = _clone(tmp_path, ".ci/run")
    called = ("setup.sh", "roce_check.sh", "wheel_check.sh", "image_test.sh", "test.sh")
    for name in called:
        _stub(root / "scripts" / name, f'#!/bin/bash\necho "{name} $PYTHON" >> "$CALLS"\n')
    proc = subprocess.run([str(root / ".ci/run")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=_env(tmp_path, PYTHON="python3.11"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = _calls(tmp_path)
    assert calls[0] == "setup.sh python3.11" and calls[-1] == "test.sh .venv/bin/python"
    # wheel_check.sh runs beside image_test.sh: their order is the scheduler's
    assert sorted(calls[1:-1]) == sorted(f"{name} .venv/bin/python" for name in called[1:-1])
