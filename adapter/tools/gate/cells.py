"""The gate's cells: what one boot is measured on, through the server's OpenAI API only.

Each cell is a function (target, plan, bar) -> (summary, samples): `summary` is a small dict, the
`samples` a list of raw records (one per request or per position), both written by run.py. A
cell's size comes from the suite (`SUITES`) and the server's reported context length: padded
prompts, the needle and the resume document are fractions of it, capped per suite.

Prompts are text (prompts.json, shipped with the package); token counts are the server's own
(`usage.prompt_tokens` of each filler paragraph, measured once per run), so the tool needs no
tokenizer and works against any OpenAI-compatible server. sglang's `ignore_eos` is passed in
`extra_body` for the speed and soak cells (other servers ignore or accept it).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import math
import threading
import time
from importlib import resources
from typing import Callable, Optional

import httpx
import numpy as np
import openai

# Per suite: "quick" fits a CI boot on 2 CPU cores (about 20 s of measurement on the dense tiny
# model); "full" is the cluster's release gate (soak 12 min, 12,000 T=1 samples, needle at 92 %
# of the context like the cluster's 969,071 of 1,048,576).
SUITES = {
    "quick": dict(speed_tokens=32, speed_reps=5, speed_prompt_cap=512, t0_tokens=16, pad_cap=8192,
                  kld_topk=5, kld_long_cap=4096, kld_long_positions=256, t1_samples=200, t1_batch=50,
                  needle_frac=0.9, needle_cap=8192, needle_tokens=8, resume_doc_frac=0.25,
                  resume_doc_cap=2048, evict_cap=65536, soak_s=6.0, soak_workers=3,
                  soak_tokens=16, companion_tokens=64),
    "full": dict(speed_tokens=256, speed_reps=5, speed_prompt_cap=2048, t0_tokens=64, pad_cap=None,
                 kld_topk=20, kld_long_cap=32768, kld_long_positions=1024, t1_samples=4000, t1_batch=100,
                 needle_frac=0.92, needle_cap=None, needle_tokens=16, resume_doc_frac=0.3,
                 resume_doc_cap=None, evict_cap=None, soak_s=720.0, soak_workers=4,
                 soak_tokens=256, companion_tokens=2048),
}
SPEED_CELLS = {f"speed-c{c}-{m}": (c, m == "sampled") for c in (1, 4) for m in ("greedy", "sampled")}
CELLS = (*SPEED_CELLS, "t0", "kld", "t1", "needle", "resume", "soak")
SAMPLED = dict(temperature=0.8, top_p=0.95)
REQUEST_TIMEOUT_S = 900.0


class GateError(RuntimeError):
    """A clear, user-facing failure (bad endpoint, mismatched resume, unusable answer)."""


def prompt_set() -> dict:
    return json.loads(resources.files("adapter.tools.gate").joinpath("prompts.json").read_text())


@dataclasses.dataclass
class Target:
    """One server: its OpenAI client, the served model, its context length and KV pool."""
    endpoint: str
    client: openai.OpenAI
    http: httpx.Client
    model: str
    context: int
    pool_tokens: Optional[int]          # sglang /server_info max_total_num_tokens, where it answers
    filler_tokens: list                 # prompt tokens of each filler paragraph
    # The server's CPU seconds so far (all processes of its process group), where the gate runs on
    # the server's machine (`gate run --server-pid`, `gate boot`): the speed cells then also
    # record output tokens per server CPU-second, which other jobs' load on a shared machine moves
    # far less than tokens per wall-second (tests/e2e/test_e2e_gate.py beside busy processes).
    server_cpu_s: Optional[Callable[[], float]] = None

    def filler(self, n_tokens: int, start: int = 0) -> str:
        """About n_tokens of filler text (paragraphs cycled from `start`)."""
        paras = prompt_set()["filler"]
        out, total, i = [], 0, start
        while total < n_tokens:
            out.append(paras[i % len(paras)])
            total += self.filler_tokens[i % len(paras)]
            i += 1
        return "".join(out)


def process_group_cpu_s(pid: int) -> Callable[[], float]:
    """A clock of the CPU seconds (user + system) of every live process in `pid`'s process group."""
    import os

    import psutil

    group = os.getpgid(pid)

    def clock() -> float:
        total = 0.0
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == group:
                    times = proc.cpu_times()
                    total += times.user + times.system
            except (psutil.Error, ProcessLookupError, OSError):
                continue        # ended between the listing and the read
        return total

    return clock


def base_url(endpoint: str) -> str:
    url = endpoint.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def connect(endpoint: str, model: Optional[str] = None, context_length: Optional[int] = None,
            api_key: str = "none") -> Target:
    """Ask the server what it serves: /v1/models (id, max_model_len), sglang's /server_info."""
    base = base_url(endpoint)
    http = httpx.Client(base_url=base, timeout=30.0)
    client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, timeout=REQUEST_TIMEOUT_S, max_retries=0)
    try:
        models = client.models.list().data
    except openai.OpenAIError as exc:
        raise GateError(f"{base}/v1/models did not answer: {exc}") from exc
    if not models:
        raise GateError(f"{base}/v1/models lists no model")
    chosen = next((m for m in models if m.id == model), None) if model else models[0]
    if chosen is None:
        raise GateError(f"model {model!r} not served at {base}; it serves {', '.join(m.id for m in models)}")
    info = {}
    try:
        resp = http.get("/server_info")
        if resp.status_code == 200:
            info = resp.json()
    except httpx.HTTPError:
        pass
    context = context_length or getattr(chosen, "max_model_len", None) or (chosen.model_extra or {}).get(
        "max_model_len") or info.get("context_length")
    if not context:
        raise GateError(f"{base} reports no context length (/v1/models max_model_len); pass --context-length")
    pool = info.get("max_total_num_tokens")
    target = Target(base, client, http, chosen.id, int(context), int(pool) if pool else None, [])
    for para in prompt_set()["filler"]:
        resp = client.completions.create(model=target.model, prompt=para, max_tokens=1, temperature=0)
        target.filler_tokens.append(int(resp.usage.prompt_tokens))
    return target


# --- plan ------------------------------------------------------------------------------------

def plan_for(suite: str, context: int) -> dict:
    """Every size a cell uses, from the suite and the context length (written to meta.json)."""
    if suite not in SUITES:
        raise GateError(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}")
    s = dict(SUITES[suite])

    def cap(frac, limit):
        n = int(frac * context)
        return min(n, limit) if limit else n

    s["pad"] = {str(f): cap(f, s["pad_cap"]) for f in (0.05, 0.25, 0.5)}
    s["speed_prompt"] = cap(0.02, s["speed_prompt_cap"])
    s["kld_long"] = cap(0.5, s["kld_long_cap"])
    s["needle"] = cap(s["needle_frac"], s["needle_cap"]) - 256      # room for the question + answer
    s["resume_doc"] = cap(s["resume_doc_frac"], s["resume_doc_cap"])
    return s


def requests_in(cell: str, plan: dict, n_t0: int) -> int:
    """How many steps a cell's progress bar counts."""
    if cell in SPEED_CELLS:
        return plan["speed_reps"]
    return {"t0": n_t0, "kld": 4, "t1": 3 * math.ceil(plan["t1_samples"] / plan["t1_batch"]),
            "needle": 1, "resume": 4, "soak": int(plan["soak_s"])}[cell]


# --- requests --------------------------------------------------------------------------------

def _usage_cached(usage) -> Optional[int]:
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = getattr(details, "cached_tokens", None) if details else None
    return None if cached is None else int(cached)


def stream_completion(t: Target, prompt: str, max_tokens: int, temperature: float = 0.0,
                      ignore_eos: bool = True, **extra) -> dict:
    """One streamed completion: TTFT, per-chunk arrival times, text, usage."""
    began = time.perf_counter()
    stream = t.client.completions.create(
        model=t.model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": ignore_eos}, **extra)
    times, text, usage = [], [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter() - began)
            text.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    end = time.perf_counter() - began
    return {"ttft_s": times[0] if times else None, "chunk_s": times, "end_s": end, "text": "".join(text),
            "completion_tokens": int(usage.completion_tokens) if usage else len(times),
            "prompt_tokens": int(usage.prompt_tokens) if usage else None, "cached_tokens": _usage_cached(usage)}


def greedy(t: Target, kind: str, text: str, max_tokens: int) -> dict:
    """T=0 output of a completion or chat prompt, with its tokens and logprobs where returned."""
    if kind == "chat":
        r = t.client.chat.completions.create(model=t.model, messages=[{"role": "user", "content": text}],
                                             max_tokens=max_tokens, temperature=0, logprobs=True)
        choice = r.choices[0]
        content = (choice.logprobs.content or []) if choice.logprobs else []
        return {"text": choice.message.content or "", "tokens": [c.token for c in content],
                "logprobs": [c.logprob for c in content], "prompt_tokens": r.usage.prompt_tokens,
                "finish_reason": choice.finish_reason}
    r = t.client.completions.create(model=t.model, prompt=text, max_tokens=max_tokens, temperature=0, logprobs=1)
    choice = r.choices[0]
    lp = choice.logprobs
    return {"text": choice.text, "tokens": list(lp.tokens or []) if lp else [],
            "logprobs": list(lp.token_logprobs or []) if lp else [], "prompt_tokens": r.usage.prompt_tokens,
            "finish_reason": choice.finish_reason}


def _pct(values, q) -> Optional[float]:
    return float(np.percentile(values, q)) if len(values) else None


# --- cells -----------------------------------------------------------------------------------

def speed(t: Target, plan: dict, bar, concurrency: int, sampled: bool):
    """Output tokens/s of `concurrency` streams of speed_tokens each, speed_reps times; TTFT, ITL."""
    text = t.filler(plan["speed_prompt"], start=3) + prompt_set()["speed"]["text"]
    prompts = [f"{text} Chapter {i + 1}." for i in range(concurrency)]
    temp = SAMPLED if sampled else {"temperature": 0.0}
    stream_completion(t, prompts[0], 4, **temp)                  # warm the prefix cache, untimed
    reps, cpu_reps, samples = [], [], []
    with cf.ThreadPoolExecutor(concurrency) as pool:
        for rep in range(plan["speed_reps"]):
            cpu_began = t.server_cpu_s() if t.server_cpu_s else None
            began = time.perf_counter()
            results = list(pool.map(lambda p: stream_completion(t, p, plan["speed_tokens"], **temp), prompts))
            wall = time.perf_counter() - began
            cpu = t.server_cpu_s() - cpu_began if cpu_began is not None else None
            tokens = sum(r["completion_tokens"] for r in results)
            reps.append(tokens / wall)
            if cpu is not None:
                cpu_reps.append(tokens / cpu if cpu > 0 else math.inf)
            for i, r in enumerate(results):
                samples.append({"rep": rep, "stream": i, "wall_s": wall, "server_cpu_s": cpu, **r})
            bar.update(1)
    ttft = [s["ttft_s"] for s in samples if s["ttft_s"] is not None]
    itl = [b - a for s in samples for a, b in zip(s["chunk_s"], s["chunk_s"][1:])]
    med = float(np.median(reps))
    summary = {"concurrency": concurrency, "sampled": sampled, "tokens_per_stream": plan["speed_tokens"],
               "tok_s": med, "tok_s_reps": reps, "spread": (max(reps) - min(reps)) / med if med else None,
               "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
               "itl_p50_s": _pct(itl, 50), "itl_p90_s": _pct(itl, 90), "itl_p99_s": _pct(itl, 99)}
    if cpu_reps:
        summary["cpu_tok_s"] = float(np.median(cpu_reps))       # output tokens per server CPU-second
        summary["cpu_tok_s_reps"] = cpu_reps
    return summary, samples


def padded(t: Target, plan: dict, item: dict, cap_key: str = "pad") -> str:
    pad = item.get("pad")
    if not pad:
        return item["text"]
    return t.filler(plan[cap_key][str(pad)] if cap_key == "pad" else plan[cap_key]) + item["text"]


def t0(t: Target, plan: dict, bar):
    """Greedy outputs of the shipped prompt set, one at a time (batch shape alike on every boot)."""
    samples = []
    for item in prompt_set()["t0"]:
        out = greedy(t, item["kind"], padded(t, plan, item), plan["t0_tokens"])
        samples.append({"id": item["id"], "kind": item["kind"], **out})
        bar.update(1)
    return {"prompts": len(samples), "max_tokens": plan["t0_tokens"],
            "prompt_tokens": {s["id"]: s["prompt_tokens"] for s in samples}}, samples


def kld(t: Target, plan: dict, bar):
    """Top-k logprobs of every prompt position (echo), short prompts and one long one; the long
    one keeps kld_long_positions evenly spaced positions."""
    ps = prompt_set()["kld"]
    items = [("short", it, it["text"]) for it in ps["short"]]
    items += [("long", it, t.filler(plan["kld_long"]) + it["text"]) for it in ps["long"]]
    samples = []
    for group, item, text in items:
        r = t.client.completions.create(model=t.model, prompt=text, max_tokens=1, temperature=0,
                                        logprobs=plan["kld_topk"], echo=True)
        lp = r.choices[0].logprobs
        n_prompt = int(r.usage.prompt_tokens)
        tops = list(lp.top_logprobs or [])[:n_prompt]
        tokens = list(lp.tokens or [])[:n_prompt]
        positions = [i for i in range(len(tops)) if tops[i]]
        if group == "long" and len(positions) > plan["kld_long_positions"]:
            step = len(positions) / plan["kld_long_positions"]
            positions = [positions[int(k * step)] for k in range(plan["kld_long_positions"])]
        samples.append({"id": item["id"], "group": group, "prompt_tokens": n_prompt, "positions": positions,
                        "tokens": [tokens[i] for i in positions], "top": [dict(tops[i]) for i in positions]})
        bar.update(1)
    if not any(s["positions"] for s in samples):
        raise GateError("the server returned no prompt top_logprobs for echo=True (the KL cell needs them)")
    return {"topk": plan["kld_topk"], "positions": {s["id"]: len(s["positions"]) for s in samples}}, samples


def t1(t: Target, plan: dict, bar):
    """First-token samples at T=1 of a few prompts (n per request), for a two-sample test."""
    samples = []
    for item in prompt_set()["t1"]:
        firsts = []
        while len(firsts) < plan["t1_samples"]:
            n = min(plan["t1_batch"], plan["t1_samples"] - len(firsts))
            r = t.client.completions.create(model=t.model, prompt=item["text"], max_tokens=1,
                                            temperature=1.0, top_p=1.0, n=n)
            firsts += [c.text for c in r.choices]
            bar.update(1)
        samples.append({"id": item["id"], "first_tokens": firsts})
    return {"samples_per_prompt": plan["t1_samples"],
            "distinct": {s["id"]: len(set(s["first_tokens"])) for s in samples}}, samples


def needle(t: Target, plan: dict, bar):
    """A fact at `depth` of about plan['needle'] filler tokens, asked for at the end (T=0)."""
    spec = prompt_set()["needle"]
    before = int(plan["needle"] * spec["depth"])
    text = t.filler(before) + spec["fact"] + t.filler(plan["needle"] - before, start=2) + spec["question"]
    r = stream_completion(t, text, plan["needle_tokens"], ignore_eos=False)
    bar.update(1)
    found = spec["answer"] in r["text"]
    summary = {"prompt_tokens": r["prompt_tokens"], "elapsed_s": r["end_s"], "ttft_s": r["ttft_s"],
               "found": found, "answer": spec["answer"], "text": r["text"]}
    return summary, [r]


def resume(t: Target, plan: dict, bar):
    """A document (cold), the document again plus a suffix (warm), distinct prompts enough to push
    its KV out of the pool, then the document plus that suffix again (evicted): TTFT, cached_tokens."""
    spec = prompt_set()["resume"]
    doc = "Document. " + t.filler(plan["resume_doc"], start=1)
    steps = {}
    steps["cold"] = stream_completion(t, doc + spec["first"], 8, ignore_eos=False)
    bar.update(1)
    steps["warm"] = stream_completion(t, doc + spec["suffix"], 8, ignore_eos=False)
    bar.update(1)
    pool = t.pool_tokens or 2 * t.context
    evict_tokens = int(1.5 * pool)
    per_prompt = max(256, min(t.context // 2, pool // 4))
    n_evict = math.ceil(evict_tokens / per_prompt)
    evicted = not plan["evict_cap"] or evict_tokens <= plan["evict_cap"]
    began = time.perf_counter()
    if evicted:
        for i in range(n_evict):
            t.client.completions.create(model=t.model, prompt=f"Note {i}: " + t.filler(per_prompt, start=i),
                                        max_tokens=1, temperature=0)
    evict_s = time.perf_counter() - began
    bar.update(1)
    steps["evicted"] = stream_completion(t, doc + spec["suffix"], 8, ignore_eos=False)
    bar.update(1)
    summary = {"doc_tokens": steps["cold"]["prompt_tokens"], "pool_tokens": t.pool_tokens,
               "evict_prompts": n_evict if evicted else 0, "evict_tokens": evict_tokens if evicted else 0,
               "evict_s": evict_s, "evicted": evicted,
               **{f"{k}_ttft_s": v["ttft_s"] for k, v in steps.items()},
               **{f"{k}_cached_tokens": v["cached_tokens"] for k, v in steps.items()},
               "texts": {k: v["text"] for k, v in steps.items()}}
    if not evicted:
        summary["skipped_eviction"] = (f"{evict_tokens} tokens would be needed to evict the pool; over the "
                                       f"suite's cap {plan['evict_cap']} (use --suite full)")
    return summary, [{"step": k, **v} for k, v in steps.items()]


METRIC_PREFIXES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                   "sglang:token_usage", "sglang:cache_hit_rate")


def soak(t: Target, plan: dict, bar):
    """soak_s of closed-loop load (soak_workers, sampled) plus one companion stream re-issued as it
    ends; every failed request counted; /metrics sampled each second where it answers."""
    texts = [it["text"] for it in prompt_set()["t0"] if not it.get("pad")]
    end = time.perf_counter() + plan["soak_s"]
    lock = threading.Lock()
    counts = {"requests": 0, "failures": 0, "companion_streams": 0, "companion_failures": 0}
    failures, metrics = [], []

    def worker(w: int) -> None:
        i = 0
        while time.perf_counter() < end:
            try:
                t.client.completions.create(model=t.model, prompt=texts[(w + i) % len(texts)],
                                            max_tokens=plan["soak_tokens"], extra_body={"ignore_eos": True},
                                            **SAMPLED)
                key = None
            except Exception as exc:  # noqa: BLE001 - a failure is the measurement
                key = f"worker {w}: {type(exc).__name__}: {str(exc)[:200]}"
            with lock:
                counts["requests"] += 1
                if key:
                    counts["failures"] += 1
                    failures.append(key)
            i += 1

    def companion() -> None:
        while time.perf_counter() < end:
            try:
                r = stream_completion(t, texts[0], plan["companion_tokens"], **SAMPLED)
                ok, why = r["completion_tokens"] == plan["companion_tokens"], "short stream"
            except Exception as exc:  # noqa: BLE001
                ok, why = False, f"{type(exc).__name__}: {str(exc)[:200]}"
            with lock:
                counts["companion_streams"] += 1
                if not ok:
                    counts["companion_failures"] += 1
                    failures.append(f"companion: {why}")

    def sample_metrics() -> None:
        began = time.perf_counter()
        while time.perf_counter() < end:
            row = {"t_s": time.perf_counter() - began}
            try:
                resp = t.http.get("/metrics")
                row["status"] = resp.status_code
                if resp.status_code == 200:
                    row["values"] = {ln.split(" ")[0]: float(ln.rsplit(" ", 1)[1]) for ln in resp.text.splitlines()
                                     if ln.startswith(METRIC_PREFIXES)}
            except (httpx.HTTPError, ValueError) as exc:
                row["status"] = f"{type(exc).__name__}"
            metrics.append(row)
            bar.update(1)
            time.sleep(max(0.0, 1.0 - (time.perf_counter() - began - row["t_s"])))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(plan["soak_workers"])]
    threads += [threading.Thread(target=companion), threading.Thread(target=sample_metrics)]
    began = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    summary = {"duration_s": time.perf_counter() - began, **counts, "failure_lines": failures[:20],
               "metrics_answered": any(m.get("status") == 200 for m in metrics), "metrics_samples": len(metrics)}
    return summary, metrics


def cell_function(cell: str) -> Callable:
    if cell in SPEED_CELLS:
        c, sampled = SPEED_CELLS[cell]
        return lambda t, plan, bar: speed(t, plan, bar, c, sampled)
    return {"t0": t0, "kld": kld, "t1": t1, "needle": needle, "resume": resume, "soak": soak}[cell]
