#!/usr/bin/env bash
# `dsv41 check` on the production line of the shipped profile (the image build's gate), run from
# outside the checkout: the interpreter's installed dsv41 (the wheel in the images and in
# scripts/wheel_check.sh; the editable checkout in the developers' .venv) is what is checked.
# PYTHON: the interpreter that runs it (default .venv/bin/python; the images set their python3).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-.venv/bin/python}
case "$PY" in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac
cd /
"$PY" -m adapter.tools.cli check --profile "$repo/.env.tp4.example" --line "${DSV41_PROFILE_LINE:-production}"
