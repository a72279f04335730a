#!/usr/bin/env bash
# The canary images' test step, which .ci/run also runs (outside Docker, with .venv): the unit
# suite (tests/ without tests/e2e) against the interpreter's own engine. It proves what an image
# adds: the swan module it built verifies and plans (tests/test_swan_*), the adapters' pins and
# hooks match the image's sglang, `dsv41 check` installs the production line. The e2e CPU
# servers (tests/e2e) are not run here: they need the CPU engine setup, and CI (scripts/test.sh)
# and `dsv41 canary` boot them.
# PYTHON defaults to .venv's; the images set it to their own interpreter. Test tools that
# interpreter lacks (requirements/test-tools.lock: pytest, hypothesis, matplotlib) are installed
# with --no-deps into a throwaway directory put first on PYTHONPATH for this run only: the image's
# packages are not touched and nothing of it stays in the image. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if ! "$PY" -c "import pytest, xdist, pytest_timeout, hypothesis, matplotlib" 2>/dev/null; then
    tools=$(mktemp -d)
    trap 'rm -rf "$tools"' EXIT
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$tools" \
        -r requirements/test-tools.lock
    export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
fi
# The tests import the checkout's adapter (tests/conftest.py); in an image its swan module was built
# into the installed wheel (SWAN_BUILD_INSTALLED=1), not into the checkout: point them there.
if [ -z "${SWAN_RUNTIME_DIR:-}" ] && [ ! -f runtime/build/swan256/manifest.json ]; then
    case "$PY" in */*) pyabs="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; *) pyabs=$PY ;; esac
    installed=$(cd / && "$pyabs" -c 'from adapter import swan; print(swan.module_dir())' 2>/dev/null || true)
    if [ -n "$installed" ] && [ -f "$installed/manifest.json" ]; then
        export SWAN_RUNTIME_DIR=$installed
        echo "[image test] swan module of the installed package: $installed"
    fi
fi
# One OpenMP thread per test process: an image's BLAS (another CPU, another thread count) would
# otherwise sum in another order than the machines the tests' tolerances were set on.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)
# --timeout: a test that hangs fails with its stack after 10 min (the slowest takes ~20 s) instead
# of holding the run until CI's own limit
"$PY" -m pytest --timeout 600 -q -p no:cacheprovider -n "${DSV41_TEST_WORKERS:-2}" --dist loadfile tests --ignore=tests/e2e "$@"
echo "[image test] unit suite in $(( $(date +%s) - start )) s"
