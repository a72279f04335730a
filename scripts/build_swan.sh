#!/usr/bin/env bash
# Build the swan256 decode module (runtime/swan256) into runtime/build/swan256/ (git-ignored):
# swan256.so + manifest.json, for sm_120a and sm_121a (SWAN_ARCHS="sm_121a" narrows it, as the
# canary images do), against the installed FlashInfer, then verify the manifest and sha256 the
# way the adapter does at load. Where nvcc is absent it builds nothing and says so once;
# DSV41_SWA_NATIVE_DECODE=1 then refuses to install (naming the key) until the module is built.
# Extra arguments go to build.py (--arch, --heads, --jobs, --out). Incremental (ninja).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvcc >/dev/null 2>&1; then
    echo "[swan] nvcc not found: swan256 module NOT built (DSV41_SWA_NATIVE_DECODE=1 will refuse to install until scripts/build_swan.sh runs where nvcc 13.0 is present)"
    exit 0
fi
PY=${PYTHON:-.venv/bin/python}
arch_args=()
for arch in ${SWAN_ARCHS:-}; do          # sm_121a -> --arch 12.1a
    digits=${arch#sm_}
    arch_args+=(--arch "${digits:0:2}.${digits:2}")
done
"$PY" runtime/swan256/build.py "${arch_args[@]}" "$@"
"$PY" - <<'PYEOF'
from adapter import swan
info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
print(f"[swan] verified {info.so_path.name} sha256 {info.sha256[:16]} "
      f"FlashInfer {info.flashinfer_version} archs {','.join(info.archs)}")
PYEOF
