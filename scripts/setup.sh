#!/usr/bin/env bash
# Create .venv with the pinned engine on CPU (requirements/cpu.lock, exact, --no-deps), install
# this project editable (console script `dsv41`), install the pinned CUDA 13.0 compiler wheels
# (requirements/cuda-build.lock, hash-checked) and build + verify the swan module with them.
# Every clone builds the module with the same nvcc, whether or not the machine has a CUDA
# toolkit; a failed build fails setup. Safe to re-run. Used by the README and by .ci/run.
# PYTHON here: the base interpreter that creates .venv (default python3; unused once .venv
# exists). Everything after runs with .venv's interpreter, passed on explicitly to the scripts
# called: they read PYTHON as the interpreter that runs everything (issue 30.6).
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PY=${PYTHON:-python3}
VENV_PY=.venv/bin/python
[ -x "$VENV_PY" ] || "$BASE_PY" -m venv .venv
"$VENV_PY" -m pip install -q --disable-pip-version-check --no-deps \
    -c requirements/constraints.txt -r requirements/cpu.lock
"$VENV_PY" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/cuda-build.lock
"$VENV_PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
PYTHON=$VENV_PY scripts/build_swan.sh
echo "[setup] .venv ready: $("$VENV_PY" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')"
