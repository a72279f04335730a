"""The tiny DeepSeek-V4 in the real CPU server (CpuServer(model="dsv4")): stock vs the production line.

Boots the server twice, one after the other (each stopped before the next boots), in the order
given by --order:
  stock       no DSV41_* key, the control line's CPU launch args (tests/e2e/e2e_configs.py's rule)
  production  the DSV41_* keys of the profile's production line (EXTRA_CONTAINER_ENV of
              .env.tp4.example, read by adapter/tools/profile.py, split by canary.split_line and
              scaled to this model by canary.model_keys) with that line's CPU launch args
both with the canary's dsv4 args (512-token chunks, --enable-metrics: the engine then returns its
own timings in each response's meta_info). On each boot, after one short warm-up request:
one greedy /generate of `--prompt-tokens` tokens (a few 512-token chunks) and `--new-tokens` out.
Printed per boot:
  boot_s              launch to /health (CpuServer.boot_s)
  prefill_tok_s       prompt tokens / (meta_info prefill_finished_time - forward_entry_time): the
                      scheduler's own clock from the first chunk's forward to the last chunk's end
                      (falls back to the tokenizer's first_token_latency if those are missing)
  decode_tok_s        meta_info decode_throughput (the engine's 1 / time per output token)
  scheduler_peak_mb   VmHWM of the scheduler process, read before the stop
  load                the machine's 1-minute load average before and after the boot's traffic
and production/stock ratios of each. This machine is shared and has 2 cores: absolute numbers
move with the load; compare the two boots of one run only (the load column says how fair that is).
No goal: the numbers are for the record.

    .venv/bin/python bench/dsv4_cpu.py [--order stock,production] [--prompt-tokens 1536]
                                       [--new-tokens 32] [--profile .env.tp4.example] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from adapter.cpu.server import CpuServer  # noqa: E402
from adapter.tools import canary, profile  # noqa: E402

MODEL = "dsv4"
METRICS = ("boot_s", "prefill_tok_s", "decode_tok_s", "scheduler_peak_mb")


def progress(msg: str) -> None:
    sys.stderr.write(f"[dsv4_cpu] {msg}\n")
    sys.stderr.flush()


def configs(profile_path: Path) -> dict:
    """{"stock": (keys, args, notes), "production": (keys, args, notes)} for the dsv4 model."""
    prod_keys, prod_args, _ = canary.split_line(profile.load_line(profile_path, "production"))
    _, ctrl_args, _ = canary.split_line(profile.load_line(profile_path, "control"))
    prod_keys, notes = canary.model_keys(MODEL, prod_keys)
    model_args = canary.MODEL_ARGS[MODEL]
    return {"stock": ({}, {**model_args, **ctrl_args}, {}),
            "production": (prod_keys, {**model_args, **prod_args}, notes)}


def prompt(n: int) -> list[int]:
    return [(i * 53 + 7) % 1000 + 3 for i in range(n)]


def scheduler_pid(server: CpuServer) -> int:
    pids = [pid for pid, role in server.roles.items() if str(role).startswith("sglang::scheduler")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one scheduler process, found roles {server.roles}")
    return pids[0]


def peak_rss_mb(pid: int) -> float:
    """VmHWM of a live process (psutil reads /proc, but the peak is not in its portable API)."""
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1)) / 1024


def measure(name: str, keys: dict, args: dict, prompt_tokens: int, new_tokens: int) -> dict:
    server = CpuServer(model=MODEL, keys=keys, args=args, name=f"bench dsv4 {name}")
    progress(f"{name}: booting ({len(keys)} DSV41 keys, args {' '.join(f'{k} {v}'.strip() for k, v in args.items())})")
    try:
        server.start()
        progress(f"{name}: up in {server.boot_s:.1f} s, logs {server.log_dir}")
        server.generate([5, 6, 7, 8], max_new_tokens=2)
        load_before = os.getloadavg()[0]
        progress(f"{name}: {prompt_tokens}-token prompt, {new_tokens} new tokens")
        began = time.monotonic()
        meta = server.generate(prompt(prompt_tokens), max_new_tokens=new_tokens, timeout=1800)["meta_info"]
        wall = time.monotonic() - began
        load_after = os.getloadavg()[0]
        if meta.get("prefill_finished_time") and meta.get("forward_entry_time"):
            prefill_s = meta["prefill_finished_time"] - meta["forward_entry_time"]
            prefill_source = "scheduler forward_entry -> prefill_finished"
        else:
            prefill_s = meta["first_token_latency"]
            prefill_source = "tokenizer first_token_latency"
        out = {"boot_s": round(server.boot_s, 1),
               "prefill_tok_s": round(prompt_tokens / prefill_s, 2),
               "decode_tok_s": round(meta["decode_throughput"], 2) if meta.get("decode_throughput") else None,
               "scheduler_peak_mb": round(peak_rss_mb(scheduler_pid(server))),
               "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens"),
               "completion_tokens": meta.get("completion_tokens"), "request_wall_s": round(wall, 1),
               "prefill_s": round(prefill_s, 2), "prefill_source": prefill_source,
               "load_1min": [round(load_before, 2), round(load_after, 2)],
               "keys": dict(sorted(keys.items())), "args": args}
        progress(f"{name}: prefill {out['prefill_tok_s']} tok/s, decode {out['decode_tok_s']} tok/s, "
                 f"scheduler peak {out['scheduler_peak_mb']} MB")
        return out
    finally:
        server.stop()


def ratios(runs: dict) -> dict:
    if "stock" not in runs or "production" not in runs:
        return {}
    out = {}
    for metric in METRICS:
        a, b = runs["stock"].get(metric), runs["production"].get(metric)
        out[metric] = round(b / a, 3) if a and b is not None else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--order", default="stock,production",
                        help="boots in this order, comma-separated (stock, production)")
    parser.add_argument("--prompt-tokens", type=int, default=1536, help="3 chunks of 512")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--profile", type=Path, default=REPO_ROOT / ".env.tp4.example")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    opts = parser.parse_args(argv)
    variants = configs(opts.profile)
    order = [v.strip() for v in opts.order.split(",") if v.strip()]
    unknown = [v for v in order if v not in variants]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {sorted(variants)}")
    runs = {}
    for name in order:
        keys, args, notes = variants[name]
        for note, why in notes.items():
            progress(f"{name}: {note}: {why}")
        runs[name] = measure(name, keys, args, opts.prompt_tokens, opts.new_tokens)
    result = {"model": MODEL, "prompt_tokens": opts.prompt_tokens, "new_tokens": opts.new_tokens,
              "order": order, "runs": runs, "production/stock": ratios(runs)}
    if opts.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    print(f"tiny DeepSeek-V4 on CPU: {opts.prompt_tokens}-token prompt, {opts.new_tokens} new tokens, "
          f"boots in order {', '.join(order)} (one run, shared 2-core machine)")
    print(f"{'':<12}" + "".join(f"{m:>20}" for m in METRICS) + f"{'load 1-min':>16}")
    for name, run in runs.items():
        print(f"{name:<12}" + "".join(f"{run[m] if run[m] is not None else '-':>20}" for m in METRICS)
              + f"{'%.1f -> %.1f' % tuple(run['load_1min']):>16}")
    if result["production/stock"]:
        print(f"{'prod/stock':<12}" + "".join(
            f"{result['production/stock'][m] if result['production/stock'][m] is not None else '-':>20}"
            for m in METRICS))
    print(f"prefill: {next(iter(runs.values()))['prefill_source']}; decode: meta_info decode_throughput")
    return 0


if __name__ == "__main__":
    sys.exit(main())
