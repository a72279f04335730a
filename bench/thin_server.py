"""swa_thin on the real CPU server: short requests, the idle-session resume and deep agent
sessions, thin vs stock.

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
on the machine moves less than wall time.
  deep      (own boots, `--deep-order`: a pool for long contexts, `--deep-total-tokens`, same SWA
            share) agent sessions grown turn by turn: `--deep-sessions` sessions interleaved (one
            request each in flight), each a `--deep-first`-token prompt, then turns of
            `--deep-turn` new tokens + the previous output, chunked at `--deep-chunk` tokens, so
            every turn passes several checkpoints at a growing depth, until `--deep-context`:
            requests/s and scheduler CPU per request (the stock core is Rust; thin's its own, the
            engine's Python core before issue 25). The model's context is 32K, but the CPU
            harness's prefill is quadratic in the context per chunk (torch_native extend runs a
            causal SDPA over the whole context: a 256-token chunk at 4K 0.6 s, at 8K 2.5 s; a cold
            8K prompt 22 s), so the defaults stop at 6K to keep a boot near two minutes; raise
            --deep-context for deeper trees at that price.
Printed: per boot, then thin vs stock as ratios of the means over each variant's boots (the
spread: each boot's value), and one line `thin/stock deep: requests/s X; scheduler CPU per
request Y`, with the goal (scheduler CPU per request thin/stock <= 1.05) met or missed. Boots take
~25-40 s each here; the default orders (4 + 4 boots) run ~10 min.

    .venv/bin/python bench/thin_server.py [--order stock,thin,stock,thin] [--requests 200]
                                          [--deep-order stock,thin,stock,thin] [--scenarios short,deep]
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
    """CPU seconds (user + system) the scheduler process has used so far (a child the scheduler
    forks keeps its title for a while: the scheduler is the one whose parent is not one)."""
    pids = {pid for pid, role in server.roles.items() if role.startswith("sglang::scheduler")}
    top = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).ppid() not in pids]
    if len(top) != 1:
        raise RuntimeError(f"expected one scheduler process, found roles {server.roles}")
    t = psutil.Process(top[0]).cpu_times()
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


DEEP_GOAL = 1.05      # scheduler CPU per request, thin/stock, deep scenario (issue 25)


def deep_args(args) -> dict:
    """Launch args of a deep boot: room for the sessions' contexts, small chunks."""
    return {"--max-total-tokens": str(args.deep_total_tokens),
            "--chunked-prefill-size": str(args.deep_chunk)}


def deep_sessions(server: CpuServer, args) -> dict:
    """Agent sessions grown turn by turn, interleaved: requests/s, scheduler CPU per request."""
    from adapter.cpu.server import output_of

    contexts = [traffic.token_ids(700 + s, args.deep_first) for s in range(args.deep_sessions)]
    limit = args.deep_context
    requests, cached, prompt_tokens = 0, 0, 0
    cpu = scheduler_cpu_s(server)
    t = time.perf_counter()
    turn = 0
    with cf.ThreadPoolExecutor(args.deep_sessions) as pool:
        while True:
            live = [i for i, c in enumerate(contexts) if len(c) + args.deep_out <= limit]
            if not live:
                break
            out = list(pool.map(lambda i: server.generate(contexts[i], max_new_tokens=args.deep_out,
                                                          timeout=900), live))
            for i, r in zip(live, out):
                requests += 1
                prompt_tokens += len(contexts[i])
                cached += int(r["meta_info"].get("cached_tokens", 0))
                contexts[i] = contexts[i] + output_of(r)[0] + traffic.token_ids(
                    1000 + 100 * turn + i, args.deep_turn)
            turn += 1
    wall = time.perf_counter() - t
    return {"deep_requests": requests, "deep_rps": requests / wall,
            "deep_cpu_ms": (scheduler_cpu_s(server) - cpu) / requests * 1e3,
            "deep_cached": cached / prompt_tokens, "deep_wall_s": wall}


def run_deep_boot(variant: str, args) -> dict:
    keys, launch, env = config(variant)
    launch = {**launch, **deep_args(args)}
    with CpuServer("swa", keys=keys, args=launch, name=f"thin-deep-{variant}", extra_env=env) as server:
        out = deep_sessions(server, args)
        boot_s = server.boot_s
    return {"variant": variant, "boot_s": boot_s, **out, "core": _core_of(server, env)}


def _core_of(server: CpuServer, env: dict) -> str:
    """Which tree core served the boot: thin's receipt line per cache it switched."""
    text = "\n".join(server.process_logs().values())
    for core in ("dsv41_thin", "python"):
        if f"tree core: {core} instead of rust" in text:
            return f"{core} (thin)"
    return "python (env)" if env else "engine default (rust)"


def run_boot(variant: str, args) -> dict:
    keys, launch, env = config(variant)
    with CpuServer("swa", keys=keys, args=launch, name=f"thin-bench-{variant}",
                   extra_env=env, admin_calls=True) as server:     # idle_resume flushes
        rps, cpu_ms = short_requests(server, args.requests, args.prompt_tokens, args.new_tokens,
                                     args.concurrency)
        resume = idle_resume(server)
        boot_s = server.boot_s
    return {"variant": variant, "boot_s": boot_s, "rps": rps, "cpu_ms": cpu_ms, **resume,
            "core": _core_of(server, env)}


def _boot(run, variant: str, args) -> dict:
    try:
        return run(variant, args)
    except BootError as exc:
        # Other work on the machine can take the free port between pick and bind: retry once.
        sys.stderr.write(f"[thin_server] boot failed ({str(exc).splitlines()[0]}); retrying\n")
        return run(variant, args)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="short,deep",
                    help="short (short requests + idle resume boots), deep (deep-session boots)")
    ap.add_argument("--order", default="stock,thin,stock,thin",
                    help="short boots in this order (alternating, so drift on the machine hits both)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--deep-order", default="stock,thin,stock,thin", help="deep boots in this order")
    ap.add_argument("--deep-sessions", type=int, default=3)
    ap.add_argument("--deep-first", type=int, default=2000, help="first prompt of a session (tokens)")
    ap.add_argument("--deep-turn", type=int, default=500, help="new tokens per turn")
    ap.add_argument("--deep-out", type=int, default=8, help="output tokens per turn")
    ap.add_argument("--deep-context", type=int, default=6000, help="a session stops before this")
    ap.add_argument("--deep-chunk", type=int, default=128, help="--chunked-prefill-size of deep boots")
    ap.add_argument("--deep-total-tokens", type=int, default=65536,
                    help="--max-total-tokens of deep boots")
    args = ap.parse_args(argv)
    scenarios = set(args.scenarios.split(","))
    if scenarios - {"short", "deep"}:
        ap.error("--scenarios: short, deep")
    orders = {"short": args.order.split(",") if "short" in scenarios else [],
              "deep": args.deep_order.split(",") if "deep" in scenarios else []}
    for name, order in orders.items():
        if order and (set(order) - set(CONFIG) or not {"stock", "thin"} <= set(order)):
            ap.error(f"the {name} order must name stock and thin, from: {', '.join(CONFIG)}")
    runs = []
    for variant in orders["short"]:
        sys.stderr.write(f"[thin_server] booting {variant}\n")
        runs.append(_boot(run_boot, variant, args))
        r = runs[-1]
        sys.stderr.write(f"[thin_server] {variant}: {r['rps']:.2f} req/s, {r['cpu_ms']:.2f} scheduler "
                         f"CPU ms/req, resume cached "
                         f"{r['cached']}/{r['session_tokens']} TTFT {r['ttft_s'] * 1e3:.0f} ms\n")
    deep = []
    for variant in orders["deep"]:
        sys.stderr.write(f"[thin_server] booting {variant} (deep)\n")
        deep.append(_boot(run_deep_boot, variant, args))
        r = deep[-1]
        sys.stderr.write(f"[thin_server] {variant} deep: {r['deep_requests']} requests in "
                         f"{r['deep_wall_s']:.0f} s, {r['deep_rps']:.3f} req/s, {r['deep_cpu_ms']:.1f} "
                         f"scheduler CPU ms/req, cached {r['deep_cached']:.1%} of prompt tokens\n")
    if runs:
        print_short(runs, args)
    if deep:
        print_deep(deep, args)
    return 0


def _means(runs, keys):
    by = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    mean = {v: {k: statistics.mean(r[k] for r in rs) for k in keys} for v, rs in by.items()}
    spread = {v: {k: f"{min(r[k] for r in rs):.4g}-{max(r[k] for r in rs):.4g}" for k in keys}
              for v, rs in by.items()}
    return by, mean, spread


def print_deep(deep, args) -> None:
    print(f"\nswa_thin deep sessions on the CPU server (swa model; {args.deep_sessions} sessions "
          f"interleaved, {args.deep_first}-token first prompt, +{args.deep_turn} tokens a turn, "
          f"{args.deep_out} out, to {args.deep_context} tokens; chunks of {args.deep_chunk}; "
          f"--max-total-tokens {args.deep_total_tokens}; boots in order {args.deep_order})")
    print(f"{'boot':>5}  {'variant':>7}  {'boot s':>6}  {'requests':>8}  {'wall s':>7}  {'req/s':>7}  "
          f"{'sched CPU ms/req':>16}  {'cached':>7}  tree core")
    for i, r in enumerate(deep, 1):
        print(f"{i:>5}  {r['variant']:>7}  {r['boot_s']:6.1f}  {r['deep_requests']:>8}  "
              f"{r['deep_wall_s']:7.1f}  {r['deep_rps']:7.3f}  {r['deep_cpu_ms']:16.1f}  "
              f"{r['deep_cached']:7.1%}  {r['core']}")
    _, mean, spread = _means(deep, ("deep_rps", "deep_cpu_ms", "deep_cached"))
    cpu = mean["thin"]["deep_cpu_ms"] / mean["stock"]["deep_cpu_ms"]
    print(f"thin/stock deep: requests/s {mean['thin']['deep_rps'] / mean['stock']['deep_rps']:.3f}; "
          f"scheduler CPU per request {cpu:.3f} "
          f"(stock {spread['stock']['deep_cpu_ms']} ms, thin {spread['thin']['deep_cpu_ms']} ms; "
          f"cached stock {mean['stock']['deep_cached']:.1%}, thin {mean['thin']['deep_cached']:.1%})")
    print(f"goal (issue 25): deep scheduler CPU per request thin/stock <= {DEEP_GOAL}: {cpu:.3f} "
          f"{'met' if cpu <= DEEP_GOAL else 'MISSED'}")
    if "python" in mean:
        print(f"python core alone / stock deep: requests/s "
              f"{mean['python']['deep_rps'] / mean['stock']['deep_rps']:.3f}; scheduler CPU per request "
              f"{mean['python']['deep_cpu_ms'] / mean['stock']['deep_cpu_ms']:.3f}")


def print_short(runs, args) -> None:
    print(f"swa_thin on the CPU server (swa model; {args.requests} x {args.prompt_tokens}-token "
          f"prompts, {args.new_tokens} out, concurrency {args.concurrency}; one run, boots in order "
          f"{args.order})")
    print(f"{'boot':>5}  {'variant':>7}  {'boot s':>6}  {'req/s':>7}  {'sched CPU ms/req':>16}  "
          f"{'resume cached':>13}  "
          f"{'resume TTFT ms':>14}  tree core")
    for i, r in enumerate(runs, 1):
        print(f"{i:>5}  {r['variant']:>7}  {r['boot_s']:6.1f}  {r['rps']:7.2f}  {r['cpu_ms']:16.2f}  "
              f"{r['cached']:>6}/{r['session_tokens']:<6}  {r['ttft_s'] * 1e3:14.1f}  {r['core']}")
    by, mean, spread = _means(runs, ("rps", "cpu_ms", "cached", "ttft_s"))
    print(f"thin/stock: requests/s {mean['thin']['rps'] / mean['stock']['rps']:.3f} "
          f"(stock {spread['stock']['rps']}, thin {spread['thin']['rps']}); "
          f"scheduler CPU per request {mean['thin']['cpu_ms'] / mean['stock']['cpu_ms']:.3f} "
          f"(stock {spread['stock']['cpu_ms']} ms, thin {spread['thin']['cpu_ms']} ms); "
          f"resume TTFT {mean['thin']['ttft_s'] / mean['stock']['ttft_s']:.3f} "
          f"(stock {spread['stock']['ttft_s']} s, thin {spread['thin']['ttft_s']} s); "
          f"resume cached tokens stock {mean['stock']['cached']:.0f}, thin {mean['thin']['cached']:.0f} "
          f"of {runs[0]['session_tokens']}")
    keeps = all(r["cached"] == r["session_tokens"] for r in by["thin"])
    loses = all(r["cached"] < r["session_tokens"] for r in by["stock"])
    print(f"idle-session resume: thin keeps it in {sum(r['cached'] == r['session_tokens'] for r in by['thin'])}"
          f"/{len(by['thin'])} boots, stock loses it in "
          f"{sum(r['cached'] < r['session_tokens'] for r in by['stock'])}/{len(by['stock'])}: "
          f"{'as before' if keeps and loses else 'CHANGED'}")
    if "python" in by:
        print(f"python core alone / stock: requests/s {mean['python']['rps'] / mean['stock']['rps']:.3f} "
              f"(python {spread['python']['rps']}), scheduler CPU per request "
              f"{mean['python']['cpu_ms'] / mean['stock']['cpu_ms']:.3f} "
              f"(python {spread['python']['cpu_ms']} ms); "
              f"thin / python core: requests/s {mean['thin']['rps'] / mean['python']['rps']:.3f}, "
              f"scheduler CPU per request {mean['thin']['cpu_ms'] / mean['python']['cpu_ms']:.3f}; "
              f"resume cached tokens python core "
              f"{mean['python']['cached']:.0f}")


if __name__ == "__main__":
    sys.exit(main())
