#!/usr/bin/env bash
# The wheel is the product: install it (not -e) into a new venv beside the locked engine with the
# images' own steps, and run it from outside the checkout with no PYTHONPATH:
#   scripts/image_install.sh   builds the wheel (`pip wheel --no-deps`) and installs it
#   scripts/build_swan.sh      SWAN_BUILD_INSTALLED=1: `python -m runtime.swan256.build` builds
#                              swan's module into the installed package, then verifies it
#   scripts/image_check.sh     `dsv41 check` on the production line: the wheel's dsv41.pth arms
#                              every enabled adapter
#   dsv41 canary --cpu-model dense   the control and production lines each boot a real CPU server
#                              from the installed package (WHEEL_CHECK_CANARY=0 skips it)
# .ci/run runs it after scripts/setup.sh. The new venv gets the locked engine's files as hard
# links of .venv's site-packages (the same requirements/cpu.lock install: no second 2.5 GB, ~3 min
# download), less .venv's editable dsv41, which pip uninstalls there: dsv41 comes from the wheel.
# PYTHON: the interpreter with the locked engine (default .venv/bin/python). WHEEL_CHECK_DIR: where
# the venv goes (default a new temporary directory, removed at the end).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
PY=${PYTHON:-.venv/bin/python}
work=${WHEEL_CHECK_DIR:-}
if [ -z "$work" ]; then
    work=$(mktemp -d "${TMPDIR:-/tmp}/dsv41-wheel-XXXXXX")
    trap 'rm -rf "$work"' EXIT
fi
start=$(date +%s)
venv="$work/venv"
rm -rf "$venv"
"$PY" -m venv --without-pip "$venv"
engine_site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
venv_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp -al "$engine_site/." "$venv_site/"
if "$venv/bin/python" -m pip show -q dsv41 >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall -q -y dsv41
fi
unset PYTHONPATH
export PYTHON="$venv/bin/python"
scripts/image_install.sh
SWAN_BUILD_INSTALLED=1 scripts/build_swan.sh --jobs "${WHEEL_CHECK_JOBS:-2}" >"$work/swan-build.log" 2>&1 \
    || { cat "$work/swan-build.log"; exit 1; }
grep '^\[swan\]' "$work/swan-build.log"
scripts/image_check.sh
if [ "${WHEEL_CHECK_CANARY:-1}" != "0" ]; then
    (cd "$work" && "$venv/bin/dsv41" canary --profile "$repo/.env.tp4.example" --cpu-model dense)
fi
echo "[wheel] the installed wheel ran from $work in $(( $(date +%s) - start )) s"
