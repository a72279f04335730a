#!/usr/bin/env bash
# Create .venv with the pinned engine on CPU (requirements/cpu.lock, exact, --no-deps), install
# this project editable (console script `dsv41`), and build the swan module where nvcc exists.
# Safe to re-run. Used by the README, by .ci/run and by the canary images.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    -c requirements/constraints.txt -r requirements/cpu.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
if [ -x scripts/build_swan.sh ]; then
    scripts/build_swan.sh
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')"
