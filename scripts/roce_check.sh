#!/usr/bin/env bash
# RoCE canary gate: the production line carries the NCCL settings TP4 over RoCE needs, and
# (inside the image, where rdma-core is present) the verbs devices are listed for the log.
# PYTHON: the interpreter that runs it (default .venv/bin/python; the images set their python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PYEOF'
import sys
from adapter.tools import profile
line = profile.load_line(".env.tp4.example", "production")
need = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_IB_GID_INDEX")
missing = [k for k in need if not line.env.get(k)]
if missing:
    sys.exit(f"[roce] production line lacks {missing}")
tp = line.arg_value("--tp-size")
if tp != "4":
    sys.exit(f"[roce] production line must run --tp-size 4, has {tp}")
print("[roce] production line:", " ".join(f"{k}={line.env[k]}" for k in need), "--tp-size", tp)
PYEOF
if command -v ibv_devices >/dev/null 2>&1; then
    ibv_devices || true
else
    echo "[roce] ibv_devices not installed here; profile check only"
fi
