#!/usr/bin/env bash
# Install this package, as its wheel (not -e), into an interpreter that already has the pinned
# engine, after checking the engine's pins: the canary images and scripts/wheel_check.sh (CI) run
# it. The wheel is built from a copy of the tracked sources (setuptools would reuse a build/ left
# in the checkout) and installed --no-deps --force-reinstall; its site-packages/dsv41.pth arms the
# line in every process of that interpreter, with no PYTHONPATH. The developers' .venv keeps its
# editable install (scripts/setup.sh): its children arm through the checkout's sitecustomize.py.
# PYTHON: that interpreter (default python3, as in the images). WHEEL_OUT: where the wheel is kept (default a
# temporary directory, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-python3}
"$PY" - <<'PYEOF'
import importlib.metadata as md, sys
want = {"sglang": "0.5.23", "flashinfer-python": "0.7.2"}
bad = {k: md.version(k) for k in want if md.version(k) != want[k]}
if bad:
    sys.exit(f"[image] engine pins violated: {bad}, want {want}")
print("[image] engine pins ok:", ", ".join(f"{k}=={v}" for k, v in want.items()))
PYEOF
tmp=$(mktemp -d "${TMPDIR:-/tmp}/dsv41-wheel-build-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
out=${WHEEL_OUT:-$tmp/dist}
src="$tmp/src"
mkdir -p "$src" "$out"
if git -C "$repo" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git -C "$repo" ls-files -z --cached --others --exclude-standard -- \
        adapter runtime pyproject.toml setup.py dsv41.pth README.md NOTICE sitecustomize.py \
        | xargs -0 cp --parents -t "$src"
else        # an image build context has no .git (.dockerignore): its files are the sources
    cp -r --parents adapter runtime pyproject.toml setup.py dsv41.pth README.md NOTICE sitecustomize.py "$src"
    find "$src" \( -name __pycache__ -o -path "$src/runtime/build" \) -prune -exec rm -rf {} +
fi
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation -w "$out" "$src"
wheel=$(ls "$out"/dsv41-*.whl)
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheel"
# its own dependencies the engine does not bring (google-re2 for input_guard's stop_regex), pinned,
# --no-deps: nothing of the engine's moves (requirements/runtime.lock)
"$PY" -m pip install -q --disable-pip-version-check --no-deps -r "$repo/requirements/runtime.lock"
"$PY" -c "import re2, wrapt" || { echo "[image] requirements/runtime.lock did not install" >&2; exit 1; }
cd /       # the installed package, not the checkout's files in the working directory
"$PY" -c "import adapter, os; print('[image] dsv41', adapter.__version__, 'installed from', '$(basename "$wheel")', 'at', os.path.dirname(adapter.__file__))"
