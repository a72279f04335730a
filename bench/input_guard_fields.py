"""What the stock engine does with a bad value in each field a client can set (issue 30): the
measurement behind input_guard's field table (docs/input_guard.md, docs/input_guard_fields.json).

The rows are built from the engine's own declarations, not from inputs that happened to fail:
every field of `TokenizedGenerateReqInput` (what the tokenizer manager sends the scheduler) and
of `SamplingParams` (both msgspec structs: their declared types), each given the wrong values
its declared type admits from JSON (a list where it declares an int, the int's extremes, a
string, a nested list where it declares a list of ids ...). Each row is one `/generate` to a
real CPU server on the dense tiny model (the request's other fields are a valid greedy prompt with
`return_logprob` and `min_new_tokens` set, so the logprob and penalizer paths run), and its
outcome is what the server did: `dies` (the scheduler's exception, the server exits), a 4xx / 5xx
status, or `200`. A death reboots the server before the next row.

    .venv/bin/python bench/input_guard_fields.py [--line stock|production] [--json F [--resume]]
        [--sampling greedy|top_k|top_p|min_p] [--route /generate|/vertex_generate]
    .venv/bin/python bench/input_guard_fields.py --markdown STOCK.json [PRODUCTION.json]

With `--line production` the same rows go to the production line (every `dies` row of stock
must be a 400 there). ~15 min for stock on an idle 2-core machine (each death costs a boot).
`--markdown` prints docs/input_guard.md's field table from the measured rows: per field, its
declared type, the scheduler-side engine modules that read it (found in the engine's source:
`.<field>` in managers/, layers/, sampling/, model_executor/, outside the tokenizer manager and
io_struct) and each bad value's outcome.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
import typing

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from adapter.cpu import cpu_engine  # noqa: E402  (the engine's structs import on CPU)

BASE = {"input_ids": [5, 6, 7, 8, 9], "return_logprob": True,
        "sampling_params": {"max_new_tokens": 3, "min_new_tokens": 1, "temperature": 0.0}}
# issue 41: the sampling path runs only at temperature > 0 (the greedy base above never reaches
# top_ks, top_ps, min_ps or the logit bias row): `--sampling` sends every row with one of these.
SAMPLING = {"greedy": {"temperature": 0.0},
            "top_k": {"temperature": 1.0, "top_k": 50},
            "top_p": {"temperature": 1.0, "top_p": 0.9},
            "min_p": {"temperature": 1.0, "min_p": 0.05}}
# The routes that take the tokenized request's fields by name: /generate, and /vertex_generate
# (its `parameters` become GenerateReqInput's fields, its instances the prompt).
ROUTES = ("/generate", "/vertex_generate")


def on_route(body: dict, route: str, sampling: str, row: dict | None = None) -> dict:
    """A row's /generate body with the sampling mode applied (the row's own bad value kept), as
    `route` takes it."""
    sp = {**body["sampling_params"], **SAMPLING[sampling]}
    if row is not None and row["struct"] == "sampling_params":
        sp[row["field"]] = row["value"]
    body = dict(body, sampling_params=sp)
    if route == "/generate":
        return body
    params = {k: v for k, v in body.items() if k != "input_ids"}
    return {"instances": [{"input_ids": body["input_ids"]}], "parameters": params}
BIG = 2 ** 40
# Tokenized fields a client does not set by that name (set by the engine, or by another field).
ENGINE_SET = {
    "input_text": "the prompt text (tokenized by the engine)",
    "input_ids": "checked by input_guard since v2.6.4 (ids outside the vocabulary)",
    "mm_inputs": "built by the multimodal processor from image/video/audio data",
    "sampling_params": "built from the sampling_params dict (its fields are rows below)",
    "time_stats": "the engine's own observability record",
    "pp_prefetch_ticketed": "set by pipeline rank 0",
    "lora_name": "from lora_path",
    "rid": "request id (string, one per request)",
    "http_worker_ipc": "set by the engine's HTTP worker",
}
SAMPLING_ENGINE_SET = {"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                       "is_normalized", "ebnf_full_assistant"}


def _kind(tp) -> str:
    """int | bool | float | str | ids | literal | other: what a declared type admits."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return _kind(args[0]) if len(args) == 1 else "other"
    if tp is bool:
        return "bool"
    if tp is int:
        return "int"
    if tp is float:
        return "float"
    if tp is str:
        return "str"
    if origin in (list, set, typing.List, typing.Set) and args and args[0] is int:
        return "ids"
    if origin is typing.Literal:
        return "literal"
    return "other"


BAD_VALUES = {
    "int": [[3], -5, BIG, -BIG, "7", 1.5],
    "bool": [[True], "yes", 2],
    "float": [[0.5], "x", 1e308],
    "str": [["a"], 5],
    "ids": [[-1], [BIG], [[1]], ["a"], 5],
    "literal": ["bogus", ["selected"]],
    "other": ["x", [1], 5],
}


def rows() -> list[dict]:
    """Every (field, bad value) row, from the engine's declared types."""
    cpu_engine.install_torchvision_shim()
    cpu_engine.install_sgl_kernel_stand_in()
    import msgspec
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    out = []
    for f in msgspec.structs.fields(TokenizedGenerateReqInput):
        if f.name in ENGINE_SET:
            continue
        kind = _kind(f.type)
        for value in BAD_VALUES[kind]:
            out.append({"struct": "request", "field": f.name, "declared": _type_name(f.type),
                        "value": value, "body": dict(BASE, **{f.name: value})})
    for f in msgspec.structs.fields(SamplingParams):
        if f.name in SAMPLING_ENGINE_SET:
            continue
        kind = _kind(f.type)
        for value in BAD_VALUES[kind]:
            body = dict(BASE, sampling_params=dict(BASE["sampling_params"], **{f.name: value}))
            out.append({"struct": "sampling_params", "field": f.name, "declared": _type_name(f.type),
                        "value": value, "body": body})
    return out


def _type_name(tp) -> str:
    return str(tp).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _exception_line(server) -> str:
    from adapter.cpu.server import error_lines
    lines = [ln for ln in error_lines(server.process_logs()) if "scheduler" in ln]
    return (lines or error_lines(server.process_logs()) or ["(no exception line)"])[-1][:300]


def _boot(server_cls, keys, args, line):
    """A server, with one more try when the boot fails (the engine's memory check reads the
    machine's free memory, which another process can take for a moment)."""
    for attempt in (1, 2):
        try:
            return server_cls("dense", keys=keys, args=args, name=f"fields-{line}").start()
        except Exception:  # noqa: BLE001 - BootError; the second failure propagates
            if attempt == 2:
                raise
            time.sleep(10)


def _row_key(row) -> str:
    return f"{row['struct']}.{row['field']}={json.dumps(row['value'])}"


def measure(line: str, progress=print, save=None, done=None, sampling: str = "greedy",
            route: str = "/generate") -> list[dict]:
    import requests

    from adapter.cpu.server import CpuServer
    from adapter.tools import canary, profile

    keys, args, _ = canary.split_line(profile.load_line(REPO_ROOT / ".env.tp4.example",
                                                        "production" if line == "production" else "control"))
    if line == "stock":
        keys = {}
    table, server, boots = rows(), None, 0
    measured = {_row_key(r): r for r in done or ()}
    began = time.monotonic()
    try:
        for i, row in enumerate(table):
            if _row_key(row) in measured:       # --resume: measured by an earlier run
                row.update(outcome=measured[_row_key(row)]["outcome"],
                           detail=measured[_row_key(row)]["detail"])
                continue
            if server is None:
                server = _boot(CpuServer, keys, args, line)
                boots += 1
            try:
                resp = requests.post(server.url + route, json=on_route(row["body"], route, sampling, row),
                                     timeout=120)
                status = resp.status_code
                detail = resp.text[:200]
            except requests.RequestException as exc:
                status, detail = None, f"{type(exc).__name__}"
            if server.survived(status, wait_s=20):
                row["outcome"] = str(status)
                row["detail"] = detail
            else:
                row["outcome"] = "dies"
                row["detail"] = _exception_line(server)
                server.stop()
                server = None
            if save is not None:
                save([r for r in table if "outcome" in r])
            progress(f"[fields] {i + 1}/{len(table)} {row['struct']}.{row['field']} = "
                     f"{json.dumps(row['value'])}: {row['outcome']}"
                     + (f" ({row['detail']})" if row["outcome"] == "dies" else ""))
    finally:
        if server is not None:
            server.stop()
    progress(f"[fields] {len(table)} rows, {boots} boots, {time.monotonic() - began:.0f} s")
    return table


def readers(field: str) -> list[str]:
    """Scheduler-side engine modules that read `.field` (the tokenizer manager and the structs'
    own module left out: they build the request)."""
    import re

    import sglang
    root = pathlib.Path(sglang.__file__).parent / "srt"
    pat = re.compile(r"\.%s\b" % re.escape(field))
    out = []
    for sub in ("managers", "layers", "sampling", "model_executor"):
        for path in sorted((root / sub).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel in ("managers/tokenizer_manager.py", "managers/io_struct.py",
                       "sampling/sampling_params.py") or "tokenizer" in path.name:
                continue
            if pat.search(path.read_text(errors="replace")):
                out.append(rel.removesuffix(".py"))
    return out


def markdown(stock: list[dict], production: list[dict] | None = None) -> str:
    """One row per field: declared type, readers, each bad value's stock (and line) outcome."""
    def outcome(r):             # a row of this run, or of docs/input_guard_fields.json
        return r.get("outcome") or r.get("stock") or r.get("line")

    prod = {(r["struct"], r["field"], json.dumps(r["value"])): outcome(r) for r in production or ()}
    by_field: dict = {}
    for r in stock:
        by_field.setdefault((r["struct"], r["field"], r["declared"]), []).append(r)
    lines = ["| field | declared type | read by (scheduler side) | bad value: stock"
             + (" / line" if production else "") + " |", "|---|---|---|---|"]
    for (struct, field, declared), rs in by_field.items():
        cells = []
        for r in rs:
            v = json.dumps(r["value"])
            out = outcome(r) + (f" / {prod[(struct, field, v)]}" if (struct, field, v) in prod else "")
            cells.append(f"`{v}`: **{out}**" if outcome(r) == "dies" else f"`{v}`: {out}")
        name = field if struct == "request" else f"sampling_params.{field}"
        read = ", ".join(readers(field)[:4]) or "no scheduler-side reader"
        lines.append(f"| `{name}` | `{declared}` | {read} | {'; '.join(cells)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--line", choices=("stock", "production"), default="stock")
    ap.add_argument("--sampling", choices=tuple(SAMPLING), default="greedy",
                    help="the sampling mode every row is sent with (issue 41: temperature > 0)")
    ap.add_argument("--route", choices=ROUTES, default="/generate")
    ap.add_argument("--json", type=pathlib.Path, help="write every row (body, outcome) here")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in --json (a run that stopped) and measure the rest")
    ap.add_argument("--markdown", type=pathlib.Path, nargs="+", metavar="JSON",
                    help="print the field table from measured rows (stock, then production)")
    a = ap.parse_args(argv)
    if a.markdown:
        rows_of = [json.loads(p.read_text()) for p in a.markdown]
        print(markdown(rows_of[0], rows_of[1] if len(rows_of) > 1 else None))
        return 0
    def save(done_rows):
        """One row a line (docs/input_guard_fields.json's format): the outcome under the line's
        name, and for a death the scheduler's exception."""
        if a.json:
            out = [{"struct": r["struct"], "field": r["field"], "declared": r["declared"],
                    "value": r["value"], a.line: r["outcome"],
                    **({f"{a.line}_dies_at": r["detail"].split("] ", 1)[-1]} if r["outcome"] == "dies" else {})}
                   for r in done_rows]
            a.json.write_text("[\n" + ",\n".join(json.dumps(r) for r in out) + "\n]\n")

    done = None
    if a.resume and a.json and a.json.exists():
        done = [dict(r, outcome=r[a.line], detail=r.get(f"{a.line}_dies_at", ""))
                for r in json.loads(a.json.read_text())]
    table = measure(a.line, save=save, done=done, sampling=a.sampling, route=a.route)
    save(table)
    dies = [r for r in table if r["outcome"] == "dies"]
    print(f"input_guard fields ({a.line}): {len(table)} rows, {len(dies)} kill the scheduler")
    for r in dies:
        print(f"  dies: {r['struct']}.{r['field']} = {json.dumps(r['value'])}: {r['detail']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
