#!/usr/bin/env bash
# The test command (README). Hadolint, then the unit suite (tests/ without tests/e2e) on two
# pytest-xdist workers (DSV41_TEST_WORKERS), then tests/e2e serially: its real CPU servers are
# shared between tests through one session and would only fight over the 2 cores in parallel.
# DSV41_TESTS=e2e runs the e2e part only (.ci/run, after scripts/image_test.sh ran the unit part).
# PYTHON: the interpreter that runs the tests (default the repo's .venv/bin/python). Extra
# arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
scripts/lint_dockerfiles.sh
if [ "${DSV41_TESTS:-all}" != "e2e" ]; then
    "$PY" -m pytest -q -p no:cacheprovider -n "${DSV41_TEST_WORKERS:-2}" tests --ignore=tests/e2e "$@"
fi
"$PY" -m pytest -q -p no:cacheprovider tests/e2e "$@"
