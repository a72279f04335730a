"""`dsv41 gate`: the A/B/A release gate as client commands against any OpenAI-compatible server.

    run      one boot's measurements under runs/<run-id>/<label>/ (run.py, cells.py)
    verdict  PASS / KILL / INVALID of an A/B/A from those files, with a report (verdict.py, report.py)
    boot     the CPU harness: control / candidate / control booted in turn, gated, judged (boot.py)

The argparse block is cli.py (added to `dsv41` by adapter/tools/cli.py).

docs/gate.md has the cells, the rules and the cluster recipe.
"""
