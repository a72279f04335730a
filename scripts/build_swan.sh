#!/usr/bin/env bash
# Build the swan256 decode module (runtime/swan256) into runtime/build/swan256/ (git-ignored):
# swan256.so + manifest.json, for sm_120a and sm_121a, against the FlashInfer installed in .venv.
# Where nvcc is absent it builds nothing and says so once; DSV41_SWA_NATIVE_DECODE=1 then refuses
# to install (naming the key) until the module is built. Extra arguments go to build.py
# (--arch, --heads, --jobs, --out). Incremental: ninja rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
    echo "[swan] nvcc not found: swan256 module NOT built (DSV41_SWA_NATIVE_DECODE=1 will refuse to install until scripts/build_swan.sh runs where nvcc 13.0 is present)"
    exit 0
fi
PY=${PYTHON_VENV:-.venv/bin/python}
exec "$PY" runtime/swan256/build.py "$@"
