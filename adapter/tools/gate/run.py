"""`dsv41 gate run`: one boot's measurements, cell by cell, under runs/<run-id>/<label>/.

Layout (one directory per boot):
    runs/<run-id>/<label>/meta.json            endpoint, model, context length, suite, plan
    runs/<run-id>/<label>/<cell>.json          the cell's summary (written last, atomically)
    runs/<run-id>/<label>/<cell>.samples.jsonl the cell's raw samples, one JSON object a line
A cell whose <cell>.json exists is measured: a second `gate run` with the same run id and label
skips it (resume after an interrupted run). Resuming with another suite, model or context length
is refused: the cells would not compare.

Run id: --run-id, or today's UTC date (YYYYMMDD), so that the three `gate run`s of one A/B/A on
one day land in one directory and a re-run resumes.
"""
from __future__ import annotations

import datetime
import json
import os
import pathlib
import sys
import time
from typing import Iterable, Optional

from tqdm import tqdm

from adapter.tools.gate import cells as C


def default_run_id() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")


def _write_json(path: pathlib.Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def _write_samples(path: pathlib.Path, samples: Iterable) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as fh:
        for s in samples:
            fh.write(json.dumps(s, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def cell_done(label_dir: pathlib.Path, cell: str) -> bool:
    return (label_dir / f"{cell}.json").is_file()


def label_complete(label_dir: pathlib.Path) -> bool:
    return all(cell_done(label_dir, c) for c in C.CELLS)


def _check_resume(meta_path: pathlib.Path, meta: dict) -> None:
    if not meta_path.is_file():
        return
    old = json.loads(meta_path.read_text())
    for key in ("suite", "model", "context_length"):
        if old.get(key) != meta[key]:
            raise C.GateError(f"{meta_path.parent} was measured with {key}={old.get(key)!r}, this run has "
                              f"{meta[key]!r}: use another --run-id or --label")


def run_gate(endpoint: str, label: str, out: str, suite: str = "quick", model: Optional[str] = None,
             run_id: Optional[str] = None, context_length: Optional[int] = None,
             cells: Iterable[str] = C.CELLS, progress: bool = True,
             server_pid: Optional[int] = None) -> pathlib.Path:
    """Measure every cell not yet measured; return the label directory.

    server_pid: a process of the server's process group on this machine; the speed cells then
    also record tokens per server CPU-second (the verdict judges speed on those when every boot
    has them)."""
    if suite not in C.SUITES:
        raise C.GateError(f"unknown suite {suite!r}; choose one of {', '.join(C.SUITES)}")
    if not label or "/" in label or label.startswith("."):
        raise C.GateError(f"bad label {label!r}: one path component, e.g. A, B, A2")
    label_dir = pathlib.Path(out) / (run_id or default_run_id()) / label
    target = C.connect(endpoint, model=model, context_length=context_length)
    if server_pid is not None:
        target.server_cpu_s = C.process_group_cpu_s(server_pid)
    plan = C.plan_for(suite, target.context)
    meta = {"label": label, "endpoint": target.endpoint, "model": target.model, "suite": suite,
            "context_length": target.context, "pool_tokens": target.pool_tokens,
            "filler_tokens": target.filler_tokens, "plan": plan}
    label_dir.mkdir(parents=True, exist_ok=True)
    _check_resume(label_dir / "meta.json", meta)
    if not (label_dir / "meta.json").is_file():
        meta["started_utc"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        _write_json(label_dir / "meta.json", meta)
    n_t0 = len(C.prompt_set()["t0"])
    for cell in cells:
        if cell_done(label_dir, cell):
            if progress:
                print(f"[gate {label}] {cell}: measured already, skipped", file=sys.stderr)
            continue
        bar = tqdm(total=C.requests_in(cell, plan, n_t0), desc=f"{label} {cell}", unit="step",
                   file=sys.stderr, disable=not progress, mininterval=0.5, leave=True)
        began = time.perf_counter()
        try:
            summary, samples = C.cell_function(cell)(target, plan, bar)
        except (C.openai.OpenAIError, C.httpx.HTTPError) as exc:
            raise C.GateError(f"{label} {cell}: the server failed: {type(exc).__name__}: {exc} (cells measured "
                              f"so far are kept: the same command resumes)") from exc
        finally:
            bar.close()
        summary = {"cell": cell, "elapsed_s": round(time.perf_counter() - began, 3), **summary}
        _write_samples(label_dir / f"{cell}.samples.jsonl", samples)
        _write_json(label_dir / f"{cell}.json", summary)
    target.http.close()
    return label_dir


def load_label(label_dir: pathlib.Path) -> dict:
    """{"meta": ..., "cells": {cell: summary}, "samples": {cell: [...]}} of one measured boot."""
    if not (label_dir / "meta.json").is_file():
        raise C.GateError(f"{label_dir}: no meta.json (not a gate run directory)")
    out = {"meta": json.loads((label_dir / "meta.json").read_text()), "cells": {}, "samples": {}}
    for cell in C.CELLS:
        path = label_dir / f"{cell}.json"
        if path.is_file():
            out["cells"][cell] = json.loads(path.read_text())
            sp = label_dir / f"{cell}.samples.jsonl"
            out["samples"][cell] = [json.loads(ln) for ln in sp.read_text().splitlines() if ln.strip()] \
                if sp.is_file() else []
    return out


def main(args) -> int:
    try:
        label_dir = run_gate(args.endpoint, args.label, args.out, suite=args.suite, model=args.model,
                             run_id=args.run_id, context_length=args.context_length,
                             server_pid=getattr(args, "server_pid", None))
    except C.GateError as exc:
        print(f"dsv41 gate run: {exc}", file=sys.stderr)
        return 2
    timings = {c: json.loads((label_dir / f"{c}.json").read_text())["elapsed_s"] for c in C.CELLS}
    if getattr(args, "json", False):
        print(json.dumps({"label_dir": str(label_dir), "label": args.label, "suite": args.suite,
                          "cells": {c: {"elapsed_s": s} for c, s in timings.items()}}, indent=2))
        return 0
    print(f"{label_dir}: {len(timings)} cells measured "
          f"({', '.join(f'{c} {s:.1f}s' for c, s in timings.items())})")
    return 0
