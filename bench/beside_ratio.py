"""What one request costs the others (issue 41): a plain stream's tokens/s beside each costly
request, over its tokens/s beside a plain request of the same length (a ratio; 1.0 = no cost).

    .venv/bin/python bench/beside_ratio.py [--line production|stock] [--rounds 3]
        [--nodes 2] [--grammar-step-ms MS] [--only "ambiguous grammar"] [--delay 2]

One CPU server (dense tiny model) of the line; `--nodes 2`: the production topology on this
machine (two launch processes, `--tp-size 2`, the TP group over gloo: the grammar step bound's
verdict is agreed over it); `--grammar-step-ms` sets DSV41_INPUT_GUARD_GRAMMAR_STEP_MS on the line
(600000: in effect no bound); `--only` runs the plain reference and the named neighbours;
`--delay`: seconds between the neighbour's start and the stream's (default 2; the ambiguous
grammar's steps grow with its output, so a later stream meets its costly steps). Each round, for each neighbour, starts the
neighbour and, 2 s later, a greedy stream of STREAM_TOKENS tokens, and times the stream from its
submission to its last token. Neighbours: a plain greedy request (the reference), an ambiguous
regex grammar, a backtracking stop_regex (RE2 on the production line), many long stop strings
(refused on the line over DSV41_INPUT_GUARD_MAX_STOP_CHARS: shown at the longest it admits).
Prints the median ratio per neighbour and each neighbour's own answer.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import pathlib
import statistics
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

STREAM_TOKENS = 64
NEIGHBOUR_TOKENS = 96
PROMPT = list(range(40, 72))


def neighbours() -> dict:
    from adapter.tools import traffic

    base = {"input_ids": list(range(100, 116))}
    greedy = {"max_new_tokens": NEIGHBOUR_TOKENS, "temperature": 0.0, "ignore_eos": True}
    return {
        "plain": {**base, "sampling_params": greedy},
        # its letter biased, so the matching grows every step
        "ambiguous grammar": {**base, "sampling_params": {
            **greedy, **traffic.ambiguous_grammar_sampling(400)}},
        "backtracking stop_regex": {**base, "sampling_params": {**greedy, "stop_regex": "(.+)+\\x00"}},
        "long stop strings": {**base, "sampling_params": {**greedy, "stop": ["x" * 2040, "y" * 2040]}},
    }


def stream_rate(url: str) -> float:
    import requests

    body = {"input_ids": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": STREAM_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    began = time.monotonic()
    last = None
    n = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as resp:
        for raw in resp.iter_lines():
            if raw.startswith(b"data:") and raw[5:].strip() != b"[DONE]":
                last = time.monotonic()
                n += 1
    return n / (last - began) if n and last > began else 0.0


def main(argv=None) -> int:
    import requests

    from adapter.cpu.server import CpuServer
    from adapter.tools import canary, profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--line", choices=("production", "stock"), default="production")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=1, help="launch processes, one TP rank each")
    ap.add_argument("--grammar-step-ms", type=int, default=None)
    ap.add_argument("--only", action="append", default=[], help="a neighbour's name (repeatable)")
    ap.add_argument("--delay", type=float, default=2.0, help="seconds from the neighbour to the stream")
    a = ap.parse_args(argv)
    keys, args, _ = canary.split_line(profile.load_line(REPO_ROOT / ".env.tp4.example",
                                                        "production" if a.line == "production" else "control"))
    if a.line == "stock":
        keys = {}
    if a.grammar_step_ms is not None:
        keys = {**keys, "DSV41_INPUT_GUARD_GRAMMAR_STEP_MS": str(a.grammar_step_ms)}
    if a.nodes > 1:
        args = {**args, "--tp-size": str(a.nodes)}
    chosen = {name: body for name, body in neighbours().items()
              if not a.only or name == "plain" or name in a.only}
    rates: dict = {name: [] for name in chosen}
    answers: dict = {}
    label = f"{a.line}, {a.nodes} node(s), stream {a.delay:g} s after" + (f", grammar step {a.grammar_step_ms} ms"
                                               if a.grammar_step_ms is not None else "")
    with CpuServer("dense", keys=keys, args=args, name=f"beside-{a.line}", nodes=a.nodes) as server:
        for _ in range(a.rounds):
            for name, body in chosen.items():
                with cf.ThreadPoolExecutor(1) as pool:
                    job = pool.submit(requests.post, server.url + "/generate", json=body, timeout=600)
                    time.sleep(a.delay)         # the neighbour is decoding
                    rates[name].append(stream_rate(server.url))
                    resp = job.result(timeout=600)
                answers[name] = f"{resp.status_code} {resp.text[:100]}"
    ref = statistics.median(rates["plain"])
    print(f"beside_ratio ({label}, {a.rounds} rounds): a {STREAM_TOKENS}-token stream's tokens/s "
          f"beside each neighbour / beside a plain one ({ref:.1f} tok/s)")
    for name, values in rates.items():
        print(f"  {name:26s} {statistics.median(values) / ref:5.2f}   neighbour: {answers[name]}")
    print(json.dumps({k: [round(v, 2) for v in vs] for k, vs in rates.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
