"""Cone replay proven where it acts: inside the engine's DeepSeek-V4 attention backend, on CPU.

    .venv/bin/python bench/cone_forward.py [--json]

Builds the engine's real DeepseekV4AttnBackend and DeepSeekV4TokenToKVPool (GB10 / SM120
dispatch, SGLANG_SM120_FLASHMLA_BACKEND=torch) with layers of compress ratio 0, 4 and 128, page
256, window 128; installs cone through the production installer; then per case compares H (a
prefix hit at F, extend [F, L)) with R (cone's replay: prefix on full KV only at s = F - N, the
session's SWA evicted and overwritten with noise, cone's plan / copy / mask / floor as production
runs them, extend [s, L)), row for row and byte for byte, then DECODE_STEPS decode steps after
each. Negative controls switch one step off and must be detected. Harness:
adapter/cpu/cone_forward/ (proof.py; model.py / indexer.py stand in for the model and the c4
indexer's query side); stand-ins: adapter/cpu/dsv4/attention.py.

Exit 0 only when every case is bit-equal (no evicted-slot read either) and every control is
detected. Progress per case on stderr. CPU seconds are process time (one torch thread).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from adapter.cpu.dsv4 import attention as dsv4_attention

    dsv4_attention.prepare()
    from adapter.cpu import cone_forward as cf

    t0 = time.process_time()
    wall0 = time.time()
    h = cf.Harness(progress=cf.log)
    try:
        if h.served_by is not None or not h.hooks_installed():
            cf.log(f"cone's forward side is not in place: served_by={h.served_by!r}, hooks "
                   f"installed={h.hooks_installed()}")
            return 1
        cases, ok = [], {}
        for case in cf.CASES:
            c0 = time.process_time()
            H, R = h.run_h(case), h.run_r(case)
            cmp = h.compare(case, H, R)
            seconds = time.process_time() - c0
            if case is cf.CONTROL_CASE:
                ok = {"H": H, "R": R}
            cf.log(f"case {case.name}: bit_equal={cmp.bit_equal} max|diff|={cmp.worst:g} "
                   f"evicted reads={R.evicted_reads} ({seconds:.1f} s CPU)")
            cases.append((case, cmp, R.evicted_reads, seconds))
        spread_case = cf.CASES[1]
        tolerance = h.spread(spread_case)
        cf.log(f"torch path spread, H of '{spread_case.name}' twice: {tolerance:g}")
        composition = h.composition_spread(spread_case)
        cf.log(f"engine spread across batch compositions (H aligned vs chunked from F): "
               f"{composition.worst:g}")
        controls = []
        for name in cf.CONTROLS:
            ctl = cf.run_control(h, name, ok, tolerance)
            cf.log(f"control {name}: max|diff|={ctl['max_abs_diff']:g} "
                   f"detected={ctl['detected']} ({ctl['seconds']} s CPU)")
            controls.append(ctl)
        backend = f"{h.backend_class.__module__}.{h.backend_class.__qualname__}"
    finally:
        h.close()
    seconds = time.process_time() - t0
    passed = (all(c.bit_equal and reads == 0 for _, c, reads, _ in cases)
              and all(ctl["detected"] for ctl in controls))

    rows = []
    for case, cmp, reads, secs in cases:
        for i, ratio in enumerate(cf.RATIOS):
            rows.append({
                "name": case.name, "ratio": ratio, "s": case.s, "F": case.F, "L": case.L,
                "N": case.N, "rows_compared": cmp.rows_compared,
                "max_abs_diff": cmp.max_abs_diff[i], "bit_equal": cmp.layer_bit_equal(i),
                "decode_steps": cmp.decode_steps,
                "decode_max_abs_diff": cmp.decode_max_abs_diff[i],
                "chunk": case.chunk, "neighbor_rows": case.neighbor,
                "pool_bytes_differing": cmp.pool_bytes_differing[i],
                "evicted_slot_reads": reads, "seconds": round(secs, 1), "note": case.note})
    result = {
        "cases": rows, "negative_controls": controls, "tolerance": tolerance,
        "seconds": round(seconds, 1), "wall_seconds": round(time.time() - wall0, 1),
        "document_seconds": round(h.doc_seconds, 1), "backend": backend,
        "engine_composition_spread": {
            "case": spread_case.name,
            "max_abs_diff_by_ratio": dict(zip(map(str, cf.RATIOS),
                                              (max(a, b) for a, b in zip(
                                                  composition.max_abs_diff,
                                                  composition.decode_max_abs_diff))))},
        "not_in_production": cf.NOT_IN_PRODUCTION, "passed": passed}
    if args.json:
        print(json.dumps(result))
    else:
        _table(result)
    return 0 if passed else 1


def _table(r: dict) -> None:
    print(f"backend: {r['backend']} (SM120 dispatch, torch sparse attention), page 256, "
          f"window 128")
    head = ("case", "ratio", "s", "F", "L", "N", "chunk", "rows", "max|diff|", "bit-equal",
            "decode", "decode max|diff|", "evicted reads", "CPU s")
    body = [(c["name"], c["ratio"], c["s"], c["F"], c["L"], c["N"], c["chunk"],
             c["rows_compared"], f"{c['max_abs_diff']:g}", "yes" if c["bit_equal"] else "NO",
             c["decode_steps"], f"{c['decode_max_abs_diff']:g}", c["evicted_slot_reads"],
             c["seconds"]) for c in r["cases"]]
    _print_table(head, body)
    print()
    for name in dict.fromkeys(c["name"] for c in r["cases"]):
        note = next(c["note"] for c in r["cases"] if c["name"] == name)
        print(f"  {name}: {note}")
    print()
    print(f"tolerance (the torch path's own spread, same batch twice): {r['tolerance']:g}")
    spread = r["engine_composition_spread"]
    print(f"engine spread across batch compositions ({spread['case']}, H aligned to R's passes "
          f"vs chunked from F, no cone in either): "
          + ", ".join(f"c{k} {v:g}" for k, v in spread["max_abs_diff_by_ratio"].items()))
    print()
    head = ("negative control", "max|diff|", "detected", "measured on")
    body = [(c["name"], f"{c['max_abs_diff']:g}", "yes" if c["detected"] else "NO", c["metric"])
            for c in r["negative_controls"]]
    _print_table(head, body)
    print()
    for c in r["negative_controls"]:
        print(f"  {c['name']}: {c['disables']}")
        for key in ("overwrote", "rows_ge_F_max_abs_diff", "evicted_slot_reads",
                    "rows_reading_evicted"):
            if key in c:
                print(f"      {key}: {c[key]}")
    print()
    print(f"not in production: {r['not_in_production']}")
    print(f"{'PASS' if r['passed'] else 'FAIL'}: {r['seconds']} s CPU ({r['wall_seconds']} s "
          f"wall; document prefill {r['document_seconds']} s CPU)")


def _print_table(head, body) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    for row in (head, *body):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


if __name__ == "__main__":
    sys.exit(main())
