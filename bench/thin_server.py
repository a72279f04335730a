"""swa_thin on the real CPU server: many short requests and the idle-session resume, thin vs stock.

Boots the tiny hybrid-SWA model ("swa", adapter/cpu/models.py) with the e2e configurations
(tests/e2e/e2e_configs.py: stock = no DSV41 key with the control line's CPU args; thin =
DSV41_SWA_THIN=1 with the production line's CPU args; --swa-prefix-tails only sizes DSV4 pools,
not this model's; optionally python = stock on the Python tree core, via the engine's
SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND), one server at a time, in the order given by --order,
each stopped before the next boots. On each:
  short     `--requests` short prompts (`--prompt-tokens` tokens, `--new-tokens` out, greedy),
            `--concurrency` in flight, after a few untimed warm-up requests: requests/s
  resume    adapter/tools/traffic.idle_session_resume after a cache flush: the cached tokens of
            the idle session's resume and its TTFT (the resume request is sent streaming, so the
            first streamed token is timed by the client; everything else is the scenario's own)
Also the scheduler process's CPU time per short request (psutil), which the load of other work
on the machine moves less than wall time. Printed: per boot, then thin vs stock as ratios of the
means over each variant's boots (the spread: each boot's value). Boots take ~25 s each here;
the default order (6 boots) runs ~7 min.

    .venv/bin/python bench/thin_server.py [--order stock,thin,python,stock,thin,python] [--requests 200]
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "e2e"))

from adapter.cpu.server import BootError, CpuServer  # noqa: E402
from adapter.tools import canary, traffic  # noqa: E402

# variant -> (name in tests/e2e/e2e_configs.CONFIGS, extra server environment)
CONFIG = {"stock": ("stock", {}), "thin": ("swa_thin", {}),
          # The core thin selects, without thin: where the difference comes from.
          "python": ("stock", {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"})}


def config(variant: str) -> tuple[dict, dict, dict]:
    import e2e_configs

    name, env = CONFIG[variant]
    keys, args = e2e_configs.CONFIGS[name]
    return dict(keys), {**canary.MODEL_ARGS["swa"], **args}, env


def scheduler_cpu_s(server: CpuServer) -> float:
    """CPU seconds (user + system) the scheduler process has used so far."""
    pids = [pid for pid, role in server.roles.items() if role.startswith("sglang::scheduler")]
    if len(pids) != 1:
        raise RuntimeError(f"expected one scheduler process, found roles {server.roles}")
    t = psutil.Process(pids[0]).cpu_times()
    return t.user + t.system


def short_requests(server: CpuServer, n: int, prompt_tokens: int, new_tokens: int,
                   concurrency: int) -> tuple[float, float]:
    """(requests/s, scheduler CPU ms per request) of n distinct short prompts, `concurrency` in
    flight. CPU time moves less than wall time with the load of other work on the machine."""
    prompts = [traffic.token_ids(5000 + i, prompt_tokens) for i in range(n)]
    for p in [traffic.token_ids(4000 + i, prompt_tokens) for i in range(2 * concurrency)]:
        server.generate(p, max_new_tokens=new_tokens)                       # warm-up, untimed
    cpu = scheduler_cpu_s(server)
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: server.generate(p, max_new_tokens=new_tokens), prompts))
    wall = time.perf_counter() - t
    return n / wall, (scheduler_cpu_s(server) - cpu) / n * 1e3


def _streamed(server: CpuServer, input_ids, max_new_tokens: int, timeout: float) -> tuple[dict, float]:
    """The same greedy request as CpuServer.generate, streamed: (last event, seconds to the first)."""
    payload = {"input_ids": list(input_ids), "return_logprob": True,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                   "ignore_eos": True}}
    t = time.perf_counter()
    ttft, last = None, None
    for last in traffic.stream_events(server.url, payload, timeout):
        if ttft is None:
            ttft = time.perf_counter() - t
    return last, ttft


def idle_resume(server: CpuServer) -> dict:
    """traffic.idle_session_resume, its resume request streamed to time its first token."""
    # The scenario's resume prompt at its defaults: the 600-token session + 40 new tokens.
    resume_prompt = traffic.token_ids(81, 600) + traffic.token_ids(82, 40)
    plain = server.generate
    seen = {}

    def generate(input_ids, max_new_tokens=16, timeout=300.0, **extra):
        if list(input_ids) != resume_prompt:
            return plain(input_ids, max_new_tokens, timeout, **extra)
        last, seen["ttft_s"] = _streamed(server, input_ids, max_new_tokens, timeout)
        return last

    server.generate = generate
    try:
        server.flush_cache(wait_s=10)
        out = traffic.idle_session_resume(server)
    finally:
        server.generate = plain
    if "ttft_s" not in seen:
        raise RuntimeError("the scenario sent no resume request with the expected prompt")
    return {"cached": out["resume"].cached_tokens, "session_tokens": out["session_tokens"],
            "ttft_s": seen["ttft_s"]}


def run_boot(variant: str, args) -> dict:
    keys, launch, env = config(variant)
    with CpuServer("swa", keys=keys, args=launch, name=f"thin-bench-{variant}",
                   extra_env=env) as server:
        rps, cpu_ms = short_requests(server, args.requests, args.prompt_tokens, args.new_tokens,
                                     args.concurrency)
        resume = idle_resume(server)
        boot_s = server.boot_s
    # Thin's receipt line per cache it switched (docs/swa_thin.md): which tree core served this boot.
    switched = any("tree core: python instead of rust" in text for text in server.process_logs().values())
    return {"variant": variant, "boot_s": boot_s, "rps": rps, "cpu_ms": cpu_ms, **resume,
            "core": "python (thin)" if switched else
                    "python (env)" if env else "engine default (rust)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--order", default="stock,thin,python,stock,thin,python",
                    help="boots in this order (alternating, so drift on the machine hits both)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args(argv)
    order = args.order.split(",")
    if set(order) - set(CONFIG) or not {"stock", "thin"} <= set(order):
        ap.error(f"--order must name stock and thin, from: {', '.join(CONFIG)}")
    runs = []
    for variant in order:
        sys.stderr.write(f"[thin_server] booting {variant}\n")
        try:
            runs.append(run_boot(variant, args))
        except BootError as exc:
            # Other work on the machine can take the free port between pick and bind: retry once.
            sys.stderr.write(f"[thin_server] boot failed ({str(exc).splitlines()[0]}); retrying\n")
            runs.append(run_boot(variant, args))
        r = runs[-1]
        sys.stderr.write(f"[thin_server] {variant}: {r['rps']:.2f} req/s, {r['cpu_ms']:.2f} scheduler "
                         f"CPU ms/req, resume cached "
                         f"{r['cached']}/{r['session_tokens']} TTFT {r['ttft_s'] * 1e3:.0f} ms\n")
    print(f"swa_thin on the CPU server (swa model; {args.requests} x {args.prompt_tokens}-token "
          f"prompts, {args.new_tokens} out, concurrency {args.concurrency}; one run, boots in order "
          f"{args.order})")
    print(f"{'boot':>5}  {'variant':>7}  {'boot s':>6}  {'req/s':>7}  {'sched CPU ms/req':>16}  "
          f"{'resume cached':>13}  "
          f"{'resume TTFT ms':>14}  tree core")
    for i, r in enumerate(runs, 1):
        print(f"{i:>5}  {r['variant']:>7}  {r['boot_s']:6.1f}  {r['rps']:7.2f}  {r['cpu_ms']:16.2f}  "
              f"{r['cached']:>6}/{r['session_tokens']:<6}  {r['ttft_s'] * 1e3:14.1f}  {r['core']}")
    by = {v: [r for r in runs if r["variant"] == v] for v in CONFIG if v in order}
    mean = {v: {k: statistics.mean(r[k] for r in rs) for k in ("rps", "cpu_ms", "cached", "ttft_s")}
            for v, rs in by.items()}
    spread = {v: {k: f"{min(r[k] for r in rs):.4g}-{max(r[k] for r in rs):.4g}"
                  for k in ("rps", "cpu_ms", "ttft_s")} for v, rs in by.items()}
    print(f"thin/stock: requests/s {mean['thin']['rps'] / mean['stock']['rps']:.3f} "
          f"(stock {spread['stock']['rps']}, thin {spread['thin']['rps']}); "
          f"scheduler CPU per request {mean['thin']['cpu_ms'] / mean['stock']['cpu_ms']:.3f} "
          f"(stock {spread['stock']['cpu_ms']} ms, thin {spread['thin']['cpu_ms']} ms); "
          f"resume TTFT {mean['thin']['ttft_s'] / mean['stock']['ttft_s']:.3f} "
          f"(stock {spread['stock']['ttft_s']} s, thin {spread['thin']['ttft_s']} s); "
          f"resume cached tokens stock {mean['stock']['cached']:.0f}, thin {mean['thin']['cached']:.0f} "
          f"of {runs[0]['session_tokens']}")
    if "python" in by:
        print(f"python core alone / stock: requests/s {mean['python']['rps'] / mean['stock']['rps']:.3f} "
              f"(python {spread['python']['rps']}), scheduler CPU per request "
              f"{mean['python']['cpu_ms'] / mean['stock']['cpu_ms']:.3f} "
              f"(python {spread['python']['cpu_ms']} ms); "
              f"thin / python core: requests/s {mean['thin']['rps'] / mean['python']['rps']:.3f}, "
              f"scheduler CPU per request {mean['thin']['cpu_ms'] / mean['python']['cpu_ms']:.3f}; "
              f"resume cached tokens python core "
              f"{mean['python']['cached']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
