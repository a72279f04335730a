#!/usr/bin/env bash
# `dsv41 check` on the production line of the shipped profile (the image build's gate).
# PYTHON: the interpreter that runs it (default .venv/bin/python; the images set their python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m adapter.tools.cli check --profile .env.tp4.example --line "${DSV41_PROFILE_LINE:-production}"
