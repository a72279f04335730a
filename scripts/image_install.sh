#!/usr/bin/env bash
# Install this package into an interpreter that already has the pinned engine, after checking
# the engine's pins. The canary images run it with the image's python; CI with .venv's.
# PYTHON: that interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PYEOF'
import importlib.metadata as md, sys
want = {"sglang": "0.5.23", "flashinfer-python": "0.7.2"}
bad = {k: md.version(k) for k in want if md.version(k) != want[k]}
if bad:
    sys.exit(f"[image] engine pins violated: {bad}, want {want}")
print("[image] engine pins ok:", ", ".join(f"{k}=={v}" for k, v in want.items()))
PYEOF
"$PY" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
"$PY" -c "import adapter; print('[image] dsv41', adapter.__version__, 'installed')"
