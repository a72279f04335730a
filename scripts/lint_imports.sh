#!/usr/bin/env bash
# The package's floors (pyproject.toml [tool.importlinter]: layers, forbidden imports, no cycles
# between sibling modules), checked by import-linter from requirements/cpu.lock (or one on PATH).
# Run from the repo root, which lint-imports puts first on sys.path: the tree checked is this one.
set -euo pipefail
cd "$(dirname "$0")/.."
LINT_IMPORTS=$(command -v .venv/bin/lint-imports || command -v lint-imports || true)
if [ -z "$LINT_IMPORTS" ]; then
    echo "[lint] lint-imports not found (install requirements/cpu.lock: import-linter, grimp)" >&2
    exit 1
fi
out=$("$LINT_IMPORTS" --no-cache 2>&1) || { echo "$out" >&2; echo "[lint] lint-imports: contracts broken" >&2; exit 1; }
echo "[lint] lint-imports: $(echo "$out" | grep -E '^Contracts: ' || echo 'contracts kept')"
