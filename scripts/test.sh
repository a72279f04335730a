#!/usr/bin/env bash
# The test command (README). Hadolint, then the unit suite (tests/ without tests/e2e, two
# pytest-xdist workers: DSV41_TEST_WORKERS) and tests/e2e side by side: the e2e servers run one at
# a time (shared between tests through one session; two would only fight over the 2 cores) and
# leave about one core idle on average (measured: 17 CPU-min in a 20-min run), which the unit suite
# takes. The unit suite's output is held in a file and printed when it ends; the script fails if
# either part fails. DSV41_TESTS=e2e / unit runs one part only (.ci/run: e2e, after
# scripts/image_test.sh ran the unit part). PYTHON: the interpreter that runs the tests (default
# the repo's .venv/bin/python). Extra arguments go to both pytest runs.
# --load N (first argument): run beside N busy processes (one busy loop each, at normal priority,
# stopped when the script ends), to check that no verdict depends on the machine's load
# (issue 40: the README records a run beside one busy process per core).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
WHICH=${DSV41_TESTS:-all}
load_pids=()
if [ "${1:-}" = "--load" ]; then
    n=${2:?"--load N: the number of busy processes"}
    shift 2
    for _ in $(seq "$n"); do
        "$PY" -c 'while True: pass' &
        load_pids+=($!)
    done
    trap 'kill "${load_pids[@]}" 2>/dev/null || true' EXIT
    echo "[test] beside $n busy processes (pids ${load_pids[*]})"
fi
scripts/lint_dockerfiles.sh
scripts/lint_imports.sh     # the package's floors (pyproject.toml [tool.importlinter])
# --timeout (pytest-timeout): a test that hangs fails with its stack instead of holding the run
# until CI's limit; per test, its fixtures' setup included: 10 min for a unit test (the slowest
# takes ~20 s), 30 min for an e2e test (its module's boots included; the longest ~8 min loaded)
# --dist loadfile: each test module on one worker, so a module-scoped fixture (an engine backend,
# a fork driver's children: tests/conftest.py run_forked) is built once, not once per worker
unit() {
    "$PY" -m pytest --timeout 600 -q -p no:cacheprovider -n "${DSV41_TEST_WORKERS:-2}" --dist loadfile tests --ignore=tests/e2e "$@"
}
e2e() {
    "$PY" -m pytest --timeout 1800 -q -p no:cacheprovider tests/e2e "$@"
}
case "$WHICH" in
    unit) unit "$@" ;;
    e2e) e2e "$@" ;;
    all)
        log=$(mktemp "${TMPDIR:-/tmp}/dsv41-unit-XXXXXX.log")
        start=$(date +%s)
        # one OpenMP thread per unit process (the servers run with one: adapter/cpu/server.py):
        # more threads than cores only spin beside the servers
        OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} unit "$@" >"$log" 2>&1 &
        unit_pid=$!
        # a stopped script (Ctrl-C, a CI timeout) stops the unit run too
        trap 'kill "$unit_pid" 2>/dev/null || true' INT TERM
        echo "[test] unit suite running beside the e2e servers (its output: $log, printed at its end)"
        e2e_rc=0
        e2e "$@" || e2e_rc=$?
        unit_rc=0
        wait "$unit_pid" || unit_rc=$?
        echo "[test] unit suite (exit $unit_rc):"
        cat "$log"
        rm -f "$log"
        echo "[test] unit exit $unit_rc, e2e exit $e2e_rc, $(( $(date +%s) - start )) s in all"
        [ "$unit_rc" -eq 0 ] && [ "$e2e_rc" -eq 0 ] ;;
    *) echo "DSV41_TESTS=$WHICH: expected all, unit or e2e" >&2; exit 2 ;;
esac
