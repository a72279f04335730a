#!/usr/bin/env bash
# The test command (README, .ci/run, and the canary images' last build step).
# PYTHON defaults to the repo's .venv; the images set it to their own interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
scripts/lint_dockerfiles.sh
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
