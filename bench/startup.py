"""Startup cost of our sitecustomize.py with no DSV41_* key set.

Runs `python -c pass` N times with the repo root on PYTHONPATH (so our sitecustomize.py runs) and
N times with an empty directory there instead, interleaved, and prints the median ratio.
Target: <= 1.05.
"""
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent


def one(pythonpath: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSV41_")}
    env["PYTHONPATH"] = pythonpath
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def main(n: int = 41) -> None:
    with tempfile.TemporaryDirectory() as empty:
        ours, base = [], []
        for _ in range(n):
            ours.append(one(str(REPO_ROOT)))
            base.append(one(empty))
    m_ours, m_base = statistics.median(ours), statistics.median(base)
    print(f"python -c pass, median of {n}: with sitecustomize {m_ours * 1e3:.2f} ms, "
          f"without {m_base * 1e3:.2f} ms, ratio {m_ours / m_base:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 41)
