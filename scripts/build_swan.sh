#!/usr/bin/env bash
# Build the swan256 decode module (runtime/swan256) into runtime/build/swan256/ (git-ignored):
# swan256.so + its router key (host C++, runtime/swan256/router_key.cpp) + manifest.json,
# for sm_120a and sm_121a (SWAN_ARCHS="sm_121a" narrows it, as the
# canary images do), against the installed FlashInfer, then verify the manifest and sha256 the
# way the adapter does at load. The compiler: CUDA_HOME if set, else the pinned CUDA 13.0 wheels
# of requirements/cuda-build.lock in the interpreter (scripts/setup.sh installs them into .venv),
# else the toolkit of nvcc on PATH (the images); none of them is an error, not a skip.
# Extra arguments go to build.py (--arch, --heads, --jobs, --out). Incremental (ninja).
# PYTHON: the interpreter that builds and verifies (default .venv/bin/python; the images set
# their python3; scripts/setup.sh passes .venv's explicitly).
# SWAN_BUILD_INSTALLED=1: build and verify the interpreter's installed package instead of this
# checkout (the images and scripts/wheel_check.sh, after scripts/image_install.sh installed the
# wheel): the module goes beside it, into site-packages/runtime/build/swan256, where the installed
# adapter looks. Both run from outside the checkout, so the installed files are the ones imported.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ "${SWAN_BUILD_INSTALLED:-0}" = "1" ]; then
    case "$PY" in /*) ;; *) PY="$(pwd)/$PY" ;; esac
    elsewhere=$(mktemp -d "${TMPDIR:-/tmp}/dsv41-swan-build-XXXXXX")
    trap 'rm -rf "$elsewhere"' EXIT
    cd "$elsewhere"
    build=(-m runtime.swan256.build)
else
    build=(runtime/swan256/build.py)
fi
arch_args=()
for arch in ${SWAN_ARCHS:-}; do          # sm_121a -> --arch 12.1a
    digits=${arch#sm_}
    arch_args+=(--arch "${digits:0:2}.${digits:2}")
done
"$PY" "${build[@]}" "${arch_args[@]}" "$@"
"$PY" - <<'PYEOF'
from adapter import swan
info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
print(f"[swan] verified {info.so_path.name} sha256 {info.sha256[:16]} "
      f"FlashInfer {info.flashinfer_version} archs {','.join(info.archs)} "
      f"(toolkit: {info.manifest.get('toolkit', 'PATH')}, nvcc {info.manifest.get('nvcc')}); "
      f"router key {info.router_key_path.name} sha256 {info.manifest['router_key']['sha256'][:16]} "
      f"torch {info.manifest['router_key']['torch_version']}")
PYEOF
