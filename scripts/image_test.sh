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
if ! "$PY" -c "import pytest, xdist, hypothesis, matplotlib" 2>/dev/null; then
    tools=$(mktemp -d)
    trap 'rm -rf "$tools"' EXIT
    "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$tools" \
        -r requirements/test-tools.lock
    export PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
fi
start=$(date +%s)
"$PY" -m pytest -q -p no:cacheprovider -n "${DSV41_TEST_WORKERS:-2}" tests --ignore=tests/e2e "$@"
echo "[image test] unit suite in $(( $(date +%s) - start )) s"
