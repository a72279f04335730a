"""`dsv41 sim thin`: idle long sessions beside sub-agent turns and new 500K sessions, then resume.

Everything runs on the engine's real UnifiedRadixCache (FULL + SWA) with its real ReqToTokenPool,
SWAKVPool and SWATokenToKVPoolAllocator (adapter/cpu/cpu_engine.py), page 256, window 128 (DSV4), and
real `Req` objects driven through the engine's own cache entry points in the scheduler's order:
`match_kv_cache` on arrival, the real PrefillAdder's `add_one_req` / `add_chunked_req` for every
pass (it locks the match; cone replay plans there), per chunk `evict_from_tree_cache` + allocation, `checkpoint_kv_cache` after every chunk (the engine's stash / post-prefill checkpoint),
`evict_sliding_windows` during decode, `release_kv_cache` at finish. Adapters are installed in this
process through the production installer (report mode) from an environment dict, so the same
scenario runs for any set of keys (control: none; thin: DSV41_SWA_THIN=1).

Token counts are the cluster's (330K / 300K idle sessions, 8192-token chunks, 500K new sessions);
only the KV tensors are tiny (one head of one element per layer), which changes no tree or
allocator decision. Requests run interleaved (round robin, one chunk or one decode block of
SGLANG_SWA_EVICTION_INTERVAL=128 tokens per turn) with at most `concurrency` in flight.

`--pool` computes the KV-pool trade-off of 128 / 256 / 384 tails from the engine's own sizing.
`--alternatives` runs the scenario once per cache alternative (`CACHE_ALTERNATIVES`: stock at 128 /
384 tails, stock with `--swa-full-tokens-ratio 0.22`, thin at 128 / 384 tails), each on its pool from
the engine's sizing (ratio mode for the ratio row), with the resumed turns' modelled prefill time.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from array import array

CHUNK = 8192
PAGE = 256
WINDOW = 128
DECODE_BLOCK = 128          # SGLANG_SWA_EVICTION_INTERVAL default: one SWA slide per block

# --- pool figures -------------------------------------------------------------------------
# SPEC figures (cluster): SWA slots and full-pool tokens per --swa-prefix-tails.
SPEC_SWA = {128: 84_480, 384: 182_784}
SPEC_FULL = {128: ("4,997,632", "5,101,824"), 256: ("~4.4M",), 384: ("3,444,224",)}
# Launch values that make the engine's own _resolve_swa_cap_tokens reproduce SPEC's 84,480 SWA
# slots at 128 tails exactly (inferred, not read off the cluster): 35 running requests,
# 8192-token chunks, no overlap schedule, no engine-level speculative algorithm.
POOL_LAUNCH = dict(max_running_requests=35, chunked_prefill_size=CHUNK, disable_overlap_schedule=True)


def _set_server_args(**extra):
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=PAGE, **extra))


def _configurator(tails: int, swa_ratio: float | None = None):
    """The engine's DSV4PoolConfigurator with the attributes its SWA cap sizing reads.

    `swa_ratio` set: the operator's --swa-full-tokens-ratio. The engine's __init__ would read it
    as `_operator_swa_full_tokens_ratio()`, which only a CLI parse marks as explicitly set, so it
    is set here directly; `_resolve_swa_cap_tokens` then returns None (ratio sizing: SWA slots =
    ratio x full tokens) and the tails size nothing, as SPEC says.
    """
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from sglang.srt.model_executor.pool_configurator import DSV4PoolConfigurator

    _set_server_args(swa_prefix_tails=tails, **POOL_LAUNCH)
    c = object.__new__(DSV4PoolConfigurator)   # the engine's own tests build it this way
    c.operator_swa_ratio = swa_ratio
    c._unified = False
    c._unified_fp8 = False
    c.requested_max_running_requests_per_worker = POOL_LAUNCH["max_running_requests"]
    c.sliding_window_size = WINDOW
    c.page_size = PAGE
    c.disaggregation_mode = "null"
    c.attn_dp_size = 1
    c.encoder_replay = False
    c.paged_draft_layers = 0
    c.request_window_bytes = 0
    c.stage_owner_layers = {}
    c.ring_sizes = {}
    c.c4_shrink_factor = 1
    c.swa_ratio = 0.0 if swa_ratio is None else swa_ratio
    c.swa_prefix_tails = c._resolve_swa_prefix_tails()
    c.swa_cap_tokens = c._resolve_swa_cap_tokens()
    return c


def pool_full_tokens(tails: int) -> int:
    """Full-pool tokens for any tails, on the line the calibrated engine sizing draws."""
    rows = {r["tails"]: r["full_tokens"] for r in pool_table()["rows"]}
    per_tail = (rows[128] - rows[384]) / 256
    return int(rows[128] - (tails - 128) * per_tail) // PAGE * PAGE


def swa_slots(tails: int) -> int:
    return _configurator(tails).swa_cap_tokens


def _calibration(full_at_128: int = 4_997_632, full_at_384: int = 3_444_224):
    """(bytes per full token, bytes per SWA slot, available bytes), calibrated from SPEC's 128- and
    384-tail full pools (see pool_table)."""
    s128, s384 = swa_slots(128), swa_slots(384)
    bytes_per_full = 1000.0                      # arbitrary unit; only the ratio is calibrated
    bytes_per_swa = (full_at_128 - full_at_384) / (s384 - s128) * bytes_per_full
    available = full_at_128 * bytes_per_full + s128 * bytes_per_swa + PAGE * bytes_per_full / 2
    return bytes_per_full, bytes_per_swa, available


def _pool_sizes(c, bytes_per_full: float, bytes_per_swa: float, available: float):
    """The engine's calculate_pool_sizes of configurator `c` with these per-token byte costs (its
    progress print silenced)."""
    import contextlib
    import io

    c.bytes_per_swa_token = bytes_per_swa
    c.bytes_per_full_token = bytes_per_full
    with contextlib.redirect_stdout(io.StringIO()):
        return c.calculate_pool_sizes(available, PAGE)


@functools.lru_cache(maxsize=None)
def ratio_pool(swa_ratio: float) -> dict:
    """SWA slots and full tokens with --swa-full-tokens-ratio set, on the same calibrated memory
    budget as pool_table: the engine's calculate_pool_sizes in ratio mode, where a full token
    also pays for `ratio` SWA slots (`_get_bytes_per_full_token`: ratio x bytes per SWA slot +
    the compressed layers' bytes, here the calibrated full-token unit) and SWA slots = ratio x
    full tokens. `tails_equivalent`: how many (window + page) tails the SWA pool holds beyond the
    engine's running-request cap (`compute_swa_request_cap`), to compare with --swa-prefix-tails.
    """
    from sglang.srt.model_executor.pool_configurator import compute_swa_request_cap

    bytes_per_full, bytes_per_swa, available = _calibration()
    c = _configurator(0, swa_ratio)
    if c.swa_cap_tokens is not None:
        raise RuntimeError("ratio sizing expected: the engine kept the tails-based SWA cap")
    c.bytes_per_swa_token = bytes_per_swa       # read by _get_bytes_per_full_token in ratio mode
    cfg = _pool_sizes(c, c._get_bytes_per_full_token() + bytes_per_full, bytes_per_swa, available)
    cap = compute_swa_request_cap(page_size=PAGE, window=WINDOW, attn_dp_size=1)
    swa = cfg.swa_max_total_num_tokens
    return {"swa_full_tokens_ratio": swa_ratio, "swa_slots": swa,
            "full_tokens": cfg.full_max_total_num_tokens,
            "contexts_1m": cfg.full_max_total_num_tokens // 1_000_000,
            "tails_equivalent": (swa - cap) // (WINDOW + PAGE)}


@functools.lru_cache(maxsize=None)
def pool_table(full_at_128: int = 4_997_632, full_at_384: int = 3_444_224):
    """SWA slots (engine sizing) and full-pool tokens per tails.

    Full tokens come from the engine's calculate_pool_sizes: full = (available - swa_cap x
    bytes_per_swa_token) / bytes_per_full_token, page-aligned. The two per-token byte costs
    depend on the model's layer layout (not available here), so only their ratio matters and it
    is calibrated, with the available bytes, from SPEC's 128- and 384-tail full pools; 256 tails
    is then a prediction of the engine's formula.
    """
    bytes_per_full, bytes_per_swa, available = _calibration(full_at_128, full_at_384)
    ratio = bytes_per_swa / bytes_per_full
    rows = []
    for tails in (128, 256, 384):
        cfg = _pool_sizes(_configurator(tails), bytes_per_full, bytes_per_swa, available)
        rows.append({"tails": tails, "swa_slots": cfg.swa_max_total_num_tokens,
                     "full_tokens": cfg.full_max_total_num_tokens,
                     "spec_swa_slots": SPEC_SWA.get(tails), "spec_full_tokens": SPEC_FULL.get(tails),
                     "contexts_1m": cfg.full_max_total_num_tokens // 1_000_000})
    return {"bytes_per_swa_over_full": round(ratio, 3), "launch": POOL_LAUNCH, "rows": rows}


def format_pool_table(table: dict) -> str:
    """`dsv41 sim thin --pool` as text: the launch values it sized with, then one row per tails
    value beside the cluster's figures (docs/cluster_evidence.md)."""
    words = []
    for name, value in table["launch"].items():
        flag = "--" + name.replace("_", "-")
        words.append(flag if value is True else f"{flag} {value}")
    head = (f"KV-pool trade-off (the engine's own sizing; launch values {' '.join(words)}; bytes per "
            f"SWA slot / bytes per full token calibrated = {table['bytes_per_swa_over_full']})")
    cols = ("tails", "SWA slots", "cluster", "full tokens", "cluster", "1M contexts")
    rows = [(str(r["tails"]), f"{r['swa_slots']:,}",
             f"{r['spec_swa_slots']:,}" if r["spec_swa_slots"] else "-", f"{r['full_tokens']:,}",
             " / ".join(r["spec_full_tokens"] or ()) or "-", str(r["contexts_1m"]))
            for r in table["rows"]]
    widths = [max(len(x[i]) for x in (cols, *rows)) for i in range(len(cols))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in (cols, *rows)]
    return "\n".join(lines)


# --- the request driver --------------------------------------------------------------------

class Tokens:
    """Distinct token ids per segment, so prefixes are shared only where a scenario shares them."""

    def __init__(self):
        self.next = 1_000

    def fresh(self, n: int) -> array:
        import numpy as np

        out = array("q")
        out.frombytes(np.arange(self.next, self.next + n, dtype=np.int64).tobytes())
        self.next += n + 7
        return out


@dataclasses.dataclass
class TurnResult:
    name: str
    prompt_len: int
    cached: int                 # device prefix the stock match found (the round it was admitted)
    prefix: int = 0             # prefix of the first pass as admitted (cone replay: s = F - N)
    prefill: int = 0            # tokens prefilled over all passes (sum of extend lengths)
    waits: int = 0              # scheduling rounds the adder did not admit it
    passes: list = dataclasses.field(default_factory=list)   # (prefix, extend) of each pass
    # full KV resident from the start at admission: the match's page-aligned resident end
    # (swa_branching_seqlen) when its window was lost, else the stock match
    full_resident: int = 0


MAX_WAIT_ROUNDS = 100_000       # a request the adder never admits is a sim bug, not a wait


class Driver:
    """Runs requests on a CpuSwaCache the way the scheduler drives the cache.

    Admission goes through the engine's real PrefillAdder: `add_one_req` for a new request (it
    selects the first pass, locks the match and, with cone replay installed, plans the replay),
    `add_chunked_req` for each further chunk; a request the adder does not admit waits a round
    (and is matched again, as the scheduler's waiting queue is). One adder per pass with
    `chunk` tokens, as one request per prefill batch.
    """

    def __init__(self, cpu, concurrency: int = 4, chunk: int = CHUNK, chunk_grid: bool = False):
        self.cpu = cpu
        self.chunk = chunk
        self.chunk_grid = chunk_grid
        self.cache = cpu.cache
        self.concurrency = concurrency
        self.results: list[TurnResult] = []
        self.trace: list[tuple[str, int, int]] = []   # (turn, node id, up_to) per checkpoint
        self._rid = 0

    def adder(self, chunk: int | None = None, pos: int = 0):
        from sglang.srt.managers.schedule_policy import PrefillAdder

        chunk = chunk or self.chunk
        budget = chunk - pos % chunk if self.chunk_grid else chunk
        return PrefillAdder(page_size=PAGE, tree_cache=self.cache,
                            token_to_kv_pool_allocator=self.cpu.allocator, running_batch=None,
                            new_token_ratio=0.5, rem_input_tokens=1 << 24,
                            rem_chunk_tokens=budget)

    # One turn as a generator: yields after each chunk and each decode block (and per round
    # the adder makes it wait).
    def turn(self, name: str, prompt: array, out_tokens: array, chunk: int | None = None):
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.mem_cache.common import (
            checkpoint_kv_cache, evict_from_tree_cache, release_kv_cache,
        )
        from sglang.srt.sampling.sampling_params import SamplingParams

        cache, cpu = self.cache, self.cpu
        chunk = chunk or self.chunk
        self._rid += 1
        req = Req(rid=f"{name}#{self._rid}", origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=len(out_tokens) + 1))
        # Admission: match_kv_cache (as the scheduler's batch build does), then the adder.
        waits = 0
        while True:
            req.init_next_round_input(cache)
            stock = req.prefix_len
            resident = max(stock, req.swa_branching_seqlen or 0)
            adder = self.adder(chunk, stock)
            adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            if any(r is req for r in adder.can_run_list):
                break
            waits = self._wait(req, waits)
            yield
        result = TurnResult(name, len(prompt), stock, req.prefix_len, 0, waits,
                            full_resident=resident)
        self.results.append(result)
        cpu.req_to_token_pool.alloc([req])
        row = req.kv.req_pool_idx
        pos = req.prefix_len
        if pos:
            cpu.req_to_token_pool.write((row, slice(0, pos)), cache.prefix_device_indices(req)[:pos])
        req.kv.kv_committed_len = req.kv.kv_allocated_len = pos
        alloc_end = pos                           # page-aligned end of what the row holds

        def grow(end):
            nonlocal alloc_end
            if end > alloc_end:
                n = -(-(end - alloc_end) // PAGE) * PAGE
                evict_from_tree_cache(cache, n)
                cpu.req_to_token_pool.write((row, slice(alloc_end, alloc_end + n)), cpu.alloc(n))
                alloc_end += n
            req.kv.kv_committed_len = req.kv.kv_allocated_len = end

        total = len(prompt)
        while True:                                # chunked prefill: passes the adder selected
            end = req.extend_end
            result.prefill += end - req.prefix_len
            result.passes.append((req.prefix_len, end - req.prefix_len))
            grow(end)
            checkpoint_kv_cache(req, cache)        # stash / post-prefill checkpoint
            self.trace.append((req.rid, req.last_node, end))
            pos = end
            yield
            if pos >= total:
                break
            while True:
                adder = self.adder(chunk, pos)
                adder.add_chunked_req(req)
                if any(r is req for r in adder.can_run_list):
                    break
                result.waits = self._wait(req, result.waits)
                yield
        for i in range(0, len(out_tokens), DECODE_BLOCK):   # decode, one SWA slide per block
            block = out_tokens[i:i + DECODE_BLOCK]
            req.output_ids.extend(block)
            pos += len(block)
            grow(pos)
            cache.evict_sliding_windows(req, pos - 1)
            yield
        req.finished_reason = FINISH_LENGTH(length=len(out_tokens))
        release_kv_cache(req, cache, checkpoint=True)
        self.trace.append((req.rid, req.last_node, pos))

    @staticmethod
    def _wait(req, waits: int) -> int:
        if waits >= MAX_WAIT_ROUNDS:
            raise RuntimeError(f"{req.rid}: the PrefillAdder admitted no pass in {waits} rounds")
        return waits + 1

    def run(self, jobs):
        """Round-robin over at most `concurrency` live turns; `jobs` is an iterator of generators
        (a job may be a generator of turns run back to back: an agent's consecutive turns)."""
        jobs = iter(jobs)
        live = []
        while True:
            while len(live) < self.concurrency:
                job = next(jobs, None)
                if job is None:
                    break
                live.append(job)
            if not live:
                return
            for job in list(live):
                try:
                    next(job)
                except StopIteration:
                    live.remove(job)


def session(driver, name, tokens, context: array, turns, out_len):
    """A multi-turn session as one job: each turn appends `turns[i]` new tokens to the context."""
    for n in turns:
        context.extend(tokens.fresh(n))
        out = tokens.fresh(out_len)
        yield from driver.turn(name, context, out)
        context.extend(out)


# --- the scenario ----------------------------------------------------------------------------

@dataclasses.dataclass
class Scenario:
    idle_sessions: tuple = (330_000, 300_000)   # context lengths of the idle sessions
    first_prompt: int = 200_000                  # their first prompt (chunked), then agent turns
    agent_turn: int = 6_000                      # new tokens per agent turn (tool result + user)
    out_len: int = 768                           # output tokens per turn
    new_sessions: int = 3                        # new 500K sessions while the two sit idle
    new_session_len: int = 500_000
    subagents: int = 40                          # sub-agents, each a few turns
    subagent_turns: int = 3
    subagent_system: int = 12_288                # shared system prompt of the sub-agents
    subagent_task: int = 6_000
    resume_turn: int = 2_000
    concurrency: int = 4


def _cone_counts() -> dict:
    from adapter import receipts

    return dict(receipts.counters["swa_cone"])


def _delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def run_scenario(tails: int, environ: dict, *, backend: str = "rust", scenario: Scenario = Scenario(),
                 full_tokens: int | None = None, swa_tokens: int | None = None,
                 check: bool = False, chunk_grid: bool = False) -> dict:
    """Build the pool for `tails`, install the adapters `environ` enables, run, report.

    `full_tokens` / `swa_tokens` override the pool (default: the engine's sizing for `tails`).
    Replays are counted from the cone adapter's own counters (`plans`, `replay_tokens`,
    fallback reasons): over the resume turns and over the whole run.
    """
    from adapter import installer
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    states = {n: s.status for n, s in installer.install_in_process(environ).items()
              if s.status != "off"}
    thin = sys.modules.get("adapter.swa_thin")
    if thin is not None:
        thin.reset_counts()
    if full_tokens is None:
        full_tokens = next((r["full_tokens"] for r in pool_table()["rows"] if r["tails"] == tails),
                           None) or pool_full_tokens(tails)
    swa = swa_tokens or swa_slots(tails)
    sc = scenario
    longest = max(sc.new_session_len, *sc.idle_sessions) + sc.resume_turn + 4 * CHUNK
    cpu = cpu_engine.build_swa_cache(full_tokens=full_tokens, swa_tokens=swa, page_size=PAGE,
                                     window=WINDOW, backend=backend, req_slots=sc.concurrency + 2,
                                     max_context_len=longest, chunked_prefill_size=CHUNK)
    core = type(cpu.cache.tree_core).__name__
    drv = Driver(cpu, concurrency=sc.concurrency, chunk_grid=chunk_grid)
    tok = Tokens()
    cone0 = _cone_counts()
    t0, c0 = time.perf_counter(), time.process_time()

    # 1. The two long sessions: a chunked first prompt, then agent turns up to their length.
    contexts = []
    jobs = []
    for i, length in enumerate(sc.idle_sessions):
        ctx = array("q")
        per_turn = sc.agent_turn + sc.out_len
        n_turns = max(0, (length - sc.first_prompt - sc.out_len) // per_turn)
        turns = [sc.first_prompt] + [sc.agent_turn] * n_turns
        contexts.append(ctx)
        jobs.append(session(drv, f"idle{i}", tok, ctx, turns, sc.out_len))
    drv.run(jobs)
    idle_lens = [len(c) for c in contexts]

    # 2. While they sit idle: sub-agents (shared system prompt) and new 500K sessions.
    system = tok.fresh(sc.subagent_system)
    traffic = []
    for j in range(sc.subagents):
        ctx = array("q", system)
        traffic.append(session(drv, f"sub{j}", tok, ctx, [sc.subagent_task] * sc.subagent_turns,
                               sc.out_len))
    for k in range(sc.new_sessions):
        ctx = array("q")
        at = (k + 1) * len(traffic) // (sc.new_sessions + 1)
        traffic.insert(at, session(drv, f"new{k}", tok, ctx, [sc.new_session_len], sc.out_len))
    drv.run(traffic)

    # 3. Resume the idle sessions, one after the other.
    resumed = []
    cone1 = _cone_counts()
    for i, ctx in enumerate(contexts):
        n = len(drv.results)
        drv.run([session(drv, f"resume{i}", tok, ctx, [sc.resume_turn], sc.out_len)])
        resumed.append(drv.results[n])
    cone_resume, cone_run = _delta(_cone_counts(), cone1), _delta(_cone_counts(), cone0)
    if check:
        cpu.cache.sanity_check()
    elapsed, cpu_s = time.perf_counter() - t0, time.process_time() - c0

    subs = [r for r in drv.results if r.name.startswith("sub")]
    out = {
        # A resume is a whole-session re-prefill when its first pass starts below half of the
        # session's context (without cone replay that is the stock match; with it, s = F - N).
        "whole_reprefills": sum(1 for r, L in zip(resumed, idle_lens) if r.prefix < L // 2),
        "resumed_cached_tokens": [r.cached for r in resumed],     # the stock match at resume
        "resumed_prefix_tokens": [r.prefix for r in resumed],     # the first pass's prefix
        "replays": cone_resume.get("plans", 0),                   # cone plans on the resumes
        "replay_tokens": cone_resume.get("replay_tokens", 0),
        "resume_prefill_tokens": sum(r.prefill for r in resumed),
        "resume_prefill_tokens_per_session": [r.prefill for r in resumed],
        "replays_whole_run": cone_run.get("plans", 0),
        "cone_fallbacks": {k.split(":", 1)[1]: v for k, v in cone_run.items()
                           if k.startswith("fallback:")},
        "_resume_passes": [r.passes for r in resumed],
        "_resume_full_resident": [r.full_resident for r in resumed],
        "_idle_lens": idle_lens,
        "_core": core,
        "_adapters": states,
        "_swa_slots": swa,
        "_full_tokens": full_tokens,
        "_subagent_prompt_tokens": sum(r.prompt_len for r in subs),
        "_subagent_cached_tokens": sum(r.cached for r in subs),
        "_subagent_prefill_tokens": sum(r.prefill for r in subs),
        "_waits": sum(r.waits for r in drv.results),
        "_thin": thin.summary() if thin is not None and states.get("swa_thin") else None,
        "_seconds": round(elapsed, 1),
        "_cpu_seconds": round(cpu_s, 1),
    }
    installer.reset_for_tests()
    return out


VARIANTS = {  # name -> environment
    "control": {},
    "thin": {"DSV41_SWA_THIN": "1"},
}


def cone_variants(tokens: int = 8192) -> dict:
    """`--cone`: control, thin, cone replay alone, thin + cone replay."""
    cone = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(tokens)}
    return {**VARIANTS, "cone": dict(cone), "thin_cone": {"DSV41_SWA_THIN": "1", **cone}}


# --- The cache alternatives (`--alternatives`, issue 43) ----------------------------------------

# What an operator would try instead of thin at 384 tails, and thin itself.
# name -> (--swa-prefix-tails, --swa-full-tokens-ratio, environment).
PUBLIC_RATIO = 0.22     # a public 4-Spark TP4 line: 0 % revisit hits by default, 100 % at 0.22
CACHE_ALTERNATIVES = {
    "stock 128": (128, None, VARIANTS["control"]),
    "stock 384": (384, None, VARIANTS["control"]),
    f"stock ratio {PUBLIC_RATIO}": (None, PUBLIC_RATIO, VARIANTS["control"]),
    "thin 128": (128, None, VARIANTS["thin"]),
    "thin 384": (384, None, VARIANTS["thin"]),
}


def alternative_pool(tails, swa_ratio) -> dict:
    """The engine's sizing for one alternative: tails-based (pool_table's line) or ratio-based."""
    if swa_ratio is not None:
        return ratio_pool(swa_ratio)
    full = pool_full_tokens(tails)
    return {"swa_slots": swa_slots(tails), "full_tokens": full, "contexts_1m": full // 1_000_000}


def modelled_prefill_s(passes) -> float:
    """Seconds of prefill forwards for a turn's passes on decode yield's cluster cost model
    (adapter/decode_yield.py pass_cost_us): the resumed turn's time to first token without queueing
    or the other traffic's passes."""
    from adapter import decode_yield as cost

    return round(sum(cost.pass_cost_us([extend], [prefix]) for prefix, extend in passes) / 1e6, 2)


def cache_alternatives(*, scenario: Scenario = Scenario(), chunk_grid: bool = True,
                       pools: dict | None = None, names=None) -> dict:
    """Run the thin scenario once per CACHE_ALTERNATIVES row on that row's pool.

    `pools` (tests): name -> (full tokens, SWA slots) replacing the engine's sizing of that row.
    """
    rows = []
    for name, (tails, swa_ratio, env) in CACHE_ALTERNATIVES.items():
        if names is not None and name not in names:
            continue
        pool = alternative_pool(tails, swa_ratio)
        if pools and name in pools:
            full, swa = pools[name]
            pool = {**pool, "swa_slots": swa, "full_tokens": full, "contexts_1m": full // 1_000_000}
        r = run_scenario(tails or 0, env, backend="rust", scenario=scenario,
                         full_tokens=pool["full_tokens"], swa_tokens=pool["swa_slots"],
                         chunk_grid=chunk_grid)
        rows.append({
            "name": name, "tails": tails, "swa_full_tokens_ratio": swa_ratio,
            "tails_equivalent": pool.get("tails_equivalent"),
            "thin": bool(env), "full_tokens": pool["full_tokens"], "swa_slots": pool["swa_slots"],
            "contexts_1m": pool["contexts_1m"],
            "whole_reprefills": r["whole_reprefills"],
            "resumed": ["cache" if prefix >= length // 2 else "re-prefill"
                        for prefix, length in zip(r["resumed_prefix_tokens"], r["_idle_lens"])],
            "resumed_cached_tokens": r["resumed_cached_tokens"],
            # a lost window with the full KV still resident (cone replay's case) or both gone
            "full_kv_resident_at_resume": r["_resume_full_resident"],
            "resume_prefill_tokens_per_session": r["resume_prefill_tokens_per_session"],
            "resume_s_modelled": [modelled_prefill_s(p) for p in r["_resume_passes"]],
            "subagent_cached_tokens": r["_subagent_cached_tokens"],
            "subagent_prompt_tokens": r["_subagent_prompt_tokens"],
            "idle_session_tokens": r["_idle_lens"], "core": r["_core"],
        })
    return {"alternatives": rows, "chunks": "grid" if chunk_grid else "engine",
            "resume_clock": "prefill passes of the resumed turn on adapter/decode_yield.py's cluster "
                            "cost model (no queueing, no other traffic)",
            "bytes_per_swa_over_full": pool_table()["bytes_per_swa_over_full"],
            "cluster": {"thin_384_resume_s": [3.9, 6.5], "stock_resume_s": [61, 64],
                        "whole_reprefills": {"thin": 0, "control": 2}}}


def print_cache_alternatives(result: dict) -> None:
    print(f"cache alternatives (engine sizing, calibrated bytes per SWA slot / full token = "
          f"{result['bytes_per_swa_over_full']}; scenario of `dsv41 sim thin`, chunks "
          f"{result['chunks']}; resume time: {result['resume_clock']})")
    print(f"{'line':<16}  {'pool':<23}  {'full tokens':>11}  {'SWA slots':>9}  {'1M ctx':>6}  "
          f"{'resumed (whole re-prefills)':<31}  {'full KV resident':>17}  "
          f"{'resume prefill tokens':>21}  resume s (modelled)")
    for r in result["alternatives"]:
        pool = (f"ratio {r['swa_full_tokens_ratio']} (~{r['tails_equivalent']} tails)"
                if r["swa_full_tokens_ratio"] is not None else f"{r['tails']} tails")
        resumed = f"{' / '.join(r['resumed'])} ({r['whole_reprefills']})"
        tokens = " / ".join(f"{t:,}" for t in r["resume_prefill_tokens_per_session"])
        secs = " / ".join(f"{t:.2f}" for t in r["resume_s_modelled"])
        resident = " / ".join(f"{t:,}" for t in r["full_kv_resident_at_resume"])
        print(f"{r['name']:<16}  {pool:<23}  {r['full_tokens']:>11,}  {r['swa_slots']:>9,}  "
              f"{r['contexts_1m']:>6}  {resumed:<31}  {resident:>17}  {tokens:>21}  {secs}")
    print("  cluster (docs/cluster_evidence.md, thin at 384 tails): resumed in 3.9 / 6.5 s instead of 61-64 s; "
          "0 whole re-prefills (2 in each control)")


def report(tails: int, variants: dict, *, scenario: Scenario = Scenario(), control_core: str = "rust",
           full_tokens: int | None = None, swa_tokens: int | None = None, check: bool = False,
           chunk_grid: bool = False) -> dict:
    """Run every variant on the same scenario, pool and chunking; internal fields keep their `_`."""
    results = {}
    for name, env in variants.items():
        backend = control_core if name == "control" else "rust"
        results[name] = run_scenario(tails, env, backend=backend, check=check, scenario=scenario,
                                     full_tokens=full_tokens, swa_tokens=swa_tokens,
                                     chunk_grid=chunk_grid)
    return results


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if not k.startswith("_")}


def as_json(tails: int, results: dict, chunks: str) -> dict:
    """The `--json` object: the issue's shape (`tails`, `control`, `thin` with `whole_reprefills`
    and `resumed_cached_tokens`) plus per-variant resume figures and the pool."""
    first = results["control"]
    return {"tails": tails, **{k: _public(v) for k, v in results.items()},
            "full_tokens": first["_full_tokens"], "swa_slots": first["_swa_slots"], "chunks": chunks}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsv41 sim thin", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tails", type=int, default=384, help="--swa-prefix-tails of the pool (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    ap.add_argument("--pool", action="store_true", help="KV-pool trade-off for 128/256/384 tails")
    ap.add_argument("--control-core", choices=("rust", "python"), default="rust",
                    help="tree core of the control run (default %(default)s, the engine's)")
    ap.add_argument("--check", action="store_true", help="run cache.sanity_check() at the end")
    ap.add_argument("--subagents", type=int, default=Scenario.subagents, help="sub-agents (default %(default)s)")
    ap.add_argument("--subagent-turns", type=int, default=Scenario.subagent_turns,
                    help="turns per sub-agent (default %(default)s)")
    ap.add_argument("--new-sessions", type=int, default=Scenario.new_sessions,
                    help="new 500K sessions while the two sit idle (default %(default)s)")
    ap.add_argument("--cone", action="store_true",
                    help="variants control, thin, cone (cone replay alone) and thin+cone")
    ap.add_argument("--cone-tokens", type=int, default=8192,
                    help="DSV41_SWA_CONE_TOKENS for the cone variants (default %(default)s)")
    ap.add_argument("--chunks", choices=("grid", "engine"), default=None,
                    help="chunk budget per pass: grid = up to the next multiple of 8192 tokens "
                         "(default without --cone), engine = a whole 8192-token chunk from the "
                         "prefix, the scheduler's own cut for one request per batch (default "
                         "with --cone)")
    ap.add_argument("--alternatives", action="store_true",
                    help="the cache alternatives on the scenario, one row each: stock at 128 / 384 "
                         f"tails, stock with --swa-full-tokens-ratio {PUBLIC_RATIO}, thin at 128 / "
                         "384 tails (pools by the engine's sizing, as --pool)")
    args = ap.parse_args(argv)
    chunks = args.chunks or ("engine" if args.cone else "grid")
    scenario = Scenario(subagents=args.subagents, subagent_turns=args.subagent_turns,
                        new_sessions=args.new_sessions)

    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    import logging
    logging.getLogger("sglang").setLevel(logging.WARNING)

    if args.pool:
        table = pool_table()
        if args.json:
            print(json.dumps(table))
            return 0
        print(format_pool_table(table))
        return 0

    if args.alternatives:
        alt = cache_alternatives(scenario=scenario, chunk_grid=chunks == "grid")
        if args.json:
            print(json.dumps(alt))
        else:
            print_cache_alternatives(alt)
        return 0

    variants = cone_variants(args.cone_tokens) if args.cone else VARIANTS
    results = report(args.tails, variants, scenario=scenario, control_core=args.control_core,
                     check=args.check, chunk_grid=chunks == "grid")
    first = results["control"]
    if args.json:
        print(json.dumps(as_json(args.tails, results, chunks)))
        return 0
    print(f"sim thin: tails {args.tails}: SWA slots {first['_swa_slots']:,}, full pool "
          f"{first['_full_tokens']:,} tokens; idle sessions {first['_idle_lens']} tokens; chunks {chunks}")
    print(f"{'variant':>9}  {'core':>19}  {'whole re-prefills':>17}  {'resumed cached tokens':>21}  "
          f"{'replays':>7}  {'resume prefill':>14}  sub-agent cached/prompt  seconds")
    for name, r in results.items():
        print(f"{name.replace('_', '+'):>9}  {r['_core']:>19}  {r['whole_reprefills']:>17}  "
              f"{str(r['resumed_cached_tokens']):>21}  {r['replays']:>7}  "
              f"{r['resume_prefill_tokens']:>14,}  "
              f"{r['_subagent_cached_tokens']:,}/{r['_subagent_prompt_tokens']:,}  {r['_seconds']}")
        if r["cone_fallbacks"]:
            print(f"{'':>9}  cone fallbacks: {r['cone_fallbacks']}; replays over the whole run "
                  f"{r['replays_whole_run']}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
