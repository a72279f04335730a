#!/usr/bin/env bash
# Create .venv with the pinned engine on CPU (requirements/cpu.lock, exact, --no-deps), install
# this project editable (console script `dsv41`), install the pinned CUDA 13.0 compiler wheels
# (requirements/cuda-build.lock, hash-checked) and build + verify the swan module with them.
# Every clone builds the module with the same nvcc, whether or not the machine has a CUDA
# toolkit; a failed build fails setup. Safe to re-run. Used by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    -c requirements/constraints.txt -r requirements/cpu.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r requirements/cuda-build.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
scripts/build_swan.sh
echo "[setup] .venv ready: $(.venv/bin/python -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')"
