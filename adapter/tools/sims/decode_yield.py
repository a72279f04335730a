"""`dsv41 sim yield [--share N|unset] [--json]`: the engine's real Scheduler loop, with a modelled clock.

Two streams decode on 300K contexts; a cold 500K prompt arrives and is prefilled in 8192-token
chunks (page 256, `--prefill-decode-interval 1` as on the production line). The loop runs twice
on fresh schedulers: stock (no adapter) and with DSV41_DECODE_YIELD installed through the
production installer. Every scheduling decision is the pinned engine's own
`Scheduler.get_next_batch_to_run` (with `_should_defer_prefill`, `_arm_prefill_decode_interval`,
the real PrefillAdder, ScheduleBatch, Req and the real UnifiedRadixCache with its pools); what
cannot run here is the forward pass, so each batch is "run" by the modelled clock of
adapter/decode_yield.py (pass_cost_us / step_cost_us) and its result is committed the way the
engine's result processor does (one token per row, finish check, checkpoint / release of KV).

cadence = stream decode rate while the 500K prompt is in prefill / the rate just before it;
first_token_ratio = that prompt's time to first token with yield / without.

`--alternatives` runs the same loop once per engine knob an operator would try instead (the
interval at 0 / 1 / 8 / 16, `--enable-mixed-chunk`, half the chunk) and once with the yield, one row
each (`ALTERNATIVES`). The interval and the mixed path are the engine's own (`prefill_decode_interval`
and `is_mixed_chunk` on the real Scheduler: PrefillAdder, `ScheduleBatch.mix_with_running`); only
the price of a mixed pass is this sim's (`extend_pass_cost_us`), since the cost model has no mixed
form.

The same harness (`build_scheduler`, `Loop`) drives the real methods in tests/test_decode_yield*.py.

A Scheduler is built with object.__new__ and only the attributes the scheduling step touches
(the real __init__ needs a model, NCCL groups and ZMQ sockets). Set here, and why:
- interval / chunk state the step reads: chunked_req, _pending_chunked_abort_req,
  prefill_decode_interval, _prefill_decode_interval_remaining, prefill_decode_interval_min_bs,
  chunked_prefill_size, dynamic_chunk_sizer=None, is_mixed_chunk, max_prefill_tokens,
  max_running_requests, max_prefill_bs, truncation_align_size=None (init_chunked_prefill /
  init_schedule_policy would set them from server args);
- the real pools and cache: tree_cache (UnifiedRadixCache FULL+SWA via cpu_engine), req_to_token_pool,
  token_to_kv_pool_allocator, page_size, device="cpu", is_hybrid_swa=True;
- real collaborators, constructed without a model: policy (SchedulePolicy "lpm"),
  new_token_ratio_tracker (NewTokenRatioTracker.from_config), beam_coordinator (BeamCoordinator,
  no live groups), dp_attn_adapter (SchedulerDPAttnAdapter, passes through without DP attention),
  ngram_embedding_manager (NgramEmbeddingManager(enabled=False)), grammar_manager (GrammarManager
  via object.__new__ with an empty grammar_queue: its __init__ needs the TP process groups),
  load_inquirer (SchedulerLoadInquirer, only its waiting-queue / chunked-req getters are live);
- feature switches off, each read by the step: enable_hierarchical_cache, enable_hicache_storage,
  enable_lmcache, enable_unified_cache_external_linker, enable_hisparse, enable_lora,
  enable_priority_scheduling, enable_priority_preemption, enable_overlap,
  enable_skip_finishing_decode, enable_continuous_input_polling, require_mlp_sync,
  dllm_config=None, prefill_delayer=None, min_free_slots_delayer=None, hisparse_coordinator=None,
  decode_offload_manager=None, mm_receiver=None, rust_server=None, scheduler_stage_metrics=None,
  spec_algorithm=NONE, disaggregation_mode=NULL, waiting_queue, result_queue, forward_ct,
  total_prefill_busy_us and decode_moment_totals (the engine's step counters, at 0),
  processed_tokens_counter, running_batch, last_batch;
- stand-ins for what cannot exist on CPU: model_config (vocab_size, is_encoder_decoder,
  is_multimodal: the real ModelConfig reads a checkpoint), tp_worker.model_runner (attn_backend,
  prefill_aware_swa: a GPU model runner), ipc_channels.send_to_tokenizer (records abort outputs
  instead of a ZMQ socket to a tokenizer process);
- the engine's pp_max_micro_batch_size default (the real __init__ overrides it in the runtime
  context the same way).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from array import array
from typing import Optional

from adapter import decode_yield as model

STREAM_CONTEXT = 300_000
PROMPT_TOKENS = 500_000
CHUNK = 8192
PAGE = 256
INTERVAL = 1          # --prefill-decode-interval on the production line
BEFORE_STEPS = 32     # decode steps measured before the prompt arrives
VOCAB = 32_000


class _TokenizerChannel:
    """Stand-in for the ZMQ channel to the tokenizer process: records what would be sent."""

    def __init__(self):
        self.sent = []

    def send_output(self, output, req=None):
        self.sent.append((output, getattr(req, "rid", None)))


def build_scheduler(*, chunk: int = CHUNK, interval: int = INTERVAL, min_bs: int = 0,
                    full_tokens: int = 65_536, swa_tokens: int = 32_768, req_slots: int = 8,
                    max_context_len: Optional[int] = None, page_size: int = PAGE,
                    backend: str = "python", mixed_chunk: bool = False, tp_rank: int = 0):
    """A real Scheduler (object.__new__) holding only what its scheduling step touches."""
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    from sglang.srt.beam_search.coordinator import BeamCoordinator
    from sglang.srt.constrained.grammar_manager import GrammarManager
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.managers.scheduler_components.dp_attn import SchedulerDPAttnAdapter
    from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (
        NewTokenRatioTracker,
    )
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import (
        NgramEmbeddingManager,
    )
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    c = cpu_engine.build_swa_cache(full_tokens=full_tokens, swa_tokens=swa_tokens,
                                   page_size=page_size, req_slots=req_slots, backend=backend,
                                   max_context_len=max_context_len or full_tokens,
                                   chunked_prefill_size=chunk)
    s = object.__new__(Scheduler)
    s.tp_rank = tp_rank                     # rank-local on a real cluster; nothing may read it
    # interval and chunk state
    s.chunked_req = None
    s._pending_chunked_abort_req = None
    s.prefill_decode_interval = interval
    s._prefill_decode_interval_remaining = 0
    s.prefill_decode_interval_min_bs = min_bs
    s.chunked_prefill_size = chunk
    s.dynamic_chunk_sizer = None
    s.is_mixed_chunk = mixed_chunk
    s.max_prefill_tokens = max(chunk, 16_384)
    s.max_running_requests = req_slots
    s.max_prefill_bs = 0
    s.truncation_align_size = None
    # pools and cache
    s.tree_cache = c.cache
    s.req_to_token_pool = c.req_to_token_pool
    s.token_to_kv_pool_allocator = c.allocator
    s.page_size = page_size
    s.device = "cpu"
    s.is_hybrid_swa = True
    # switches the step reads
    for name in ("enable_hierarchical_cache", "enable_hicache_storage", "enable_lmcache",
                 "enable_unified_cache_external_linker", "enable_hisparse", "enable_lora",
                 "enable_priority_scheduling", "enable_priority_preemption", "enable_overlap",
                 "enable_skip_finishing_decode", "enable_continuous_input_polling",
                 "require_mlp_sync"):
        setattr(s, name, False)
    for name in ("dllm_config", "prefill_delayer", "min_free_slots_delayer",
                 "hisparse_coordinator", "decode_offload_manager", "mm_receiver", "rust_server",
                 "scheduler_stage_metrics"):
        setattr(s, name, None)
    s.priority_scheduling_preemption_threshold = 0
    s.spec_algorithm = SpeculativeAlgorithm.NONE
    s.disaggregation_mode = DisaggregationMode.NULL
    s.waiting_queue = []
    s.result_queue = []
    s.forward_ct = 0
    # the engine's step counters (Scheduler.__init__ sets them; _record_step_counters feeds them
    # from the real clock after each forward, which the modelled loop does not run): decode
    # yield's achieved-share measurement reads them
    s.total_prefill_busy_us, s.decode_moment_totals = 0, [0.0] * 6
    s.processed_tokens_counter = 0
    s.running_batch = ScheduleBatch(reqs=[])
    s.last_batch = None
    # stand-ins for what needs a GPU model / other processes
    s.model_config = types.SimpleNamespace(vocab_size=VOCAB, is_encoder_decoder=False,
                                           is_multimodal=False)
    s.tp_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(
        attn_backend=None, prefill_aware_swa=False))
    s.ipc_channels = types.SimpleNamespace(send_to_tokenizer=_TokenizerChannel())
    # real collaborators
    s.policy = SchedulePolicy("lpm", c.cache, False, False, False)
    s.new_token_ratio_tracker = NewTokenRatioTracker.from_config()
    s.beam_coordinator = BeamCoordinator(
        model_config=s.model_config, spec_algorithm=s.spec_algorithm, dllm_enabled=False,
        max_req_len=max_context_len or full_tokens, req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, tree_cache=s.tree_cache,
        future_map=None)
    s.dp_attn_adapter = SchedulerDPAttnAdapter(
        model_runner=s.tp_worker.model_runner, req_to_token_pool=s.req_to_token_pool,
        token_to_kv_pool_allocator=s.token_to_kv_pool_allocator, tree_cache=s.tree_cache,
        offload_tags=set(), model_config=s.model_config, enable_overlap=False,
        spec_algorithm=s.spec_algorithm, get_require_mlp_sync=lambda: s.require_mlp_sync)
    s.ngram_embedding_manager = NgramEmbeddingManager(enabled=False, table=None, n=0)
    s.grammar_manager = object.__new__(GrammarManager)
    s.grammar_manager.grammar_queue = []
    required = {f.name: None for f in dataclasses.fields(SchedulerLoadInquirer)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    required.update(get_waiting_queue=lambda: s.waiting_queue,
                    get_chunked_req=lambda: s.chunked_req)
    s.load_inquirer = SchedulerLoadInquirer(**required)
    get_context().override("scheduler.pp_max_micro_batch_size_default",
                           pp_max_micro_batch_size=req_slots)
    s._dsv41_cpu_cache = c
    return s


def make_req(rid: str, tokens: int, *, max_new_tokens: int, salt: int = 0):
    """A real Req with a prompt of `tokens` ids that shares no prefix with other salts."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    ids = array("q", (1 + (salt * 7919 + i) % (VOCAB - 1) for i in range(tokens)))
    ids[0] = 1 + salt % (VOCAB - 1)
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    params.normalize(None)
    return Req(rid=rid, origin_input_text="", origin_input_ids=ids, sampling_params=params)


def extend_pass_cost_us(batch) -> int:
    """Modelled time of an extend pass on the clock of adapter/decode_yield.py.

    A plain extend is `pass_cost_us` over its requests. A mixed pass (`--enable-mixed-chunk`: the
    engine's `mix_with_running` put the running streams' decode rows into the extend, listed in
    `batch.decoding_reqs` and appended to `batch.reqs` with extend length 1) is priced by this sim,
    not by the adapter's cost model, which has no mixed form and would price each row as a
    one-token chunk (its pair term: ~0.1 ms at 300K). Each decode row's attention still reads its
    whole context, as in a decode step, so a row costs the decode step's per-row and per-context
    terms; only the step's fixed term (one forward's weights and collectives) is shared with the
    chunk's forward.
    """
    rows = list(batch.decoding_reqs or ())
    prefill = len(batch.reqs) - len(rows)           # mix_with_running appends the rows last
    cost = model.pass_cost_us(batch.extend_lens[:prefill], batch.prefix_lens[:prefill])
    if rows:
        cost += (model.step_cost_us(len(rows), sum(r.seqlen for r in rows))
                 - model.CLUSTER.step_fixed_us)
    return cost


@dataclasses.dataclass
class Step:
    """One scheduling step as the engine decided it."""
    kind: str                          # "extend" | "decode" | "idle"
    rids: tuple                        # requests of the batch, in batch order
    spans: tuple = ()                  # extend: (rid, prefix_len, extend_len) per request
    cost_us: int = 0                   # modelled time of the batch
    deferred: Optional[bool] = None    # what _should_defer_prefill answered (None: not asked)
    rows: tuple = (0, 0)               # extend: (decode rows, their context tokens) at that step


class Loop:
    """The engine's event_loop_normal with run_batch replaced by the modelled clock.

    Per step: plan = scheduler.get_next_batch_to_run(running_batch, last_batch) (the real one,
    wrapped when the adapter is installed); then the batch "runs" for its modelled cost and its
    result is committed as the engine's result processor does.
    """

    TOKEN = 11

    def __init__(self, scheduler):
        self.s = scheduler
        self.clock_us = 0
        self.trace: list[Step] = []
        self.first_token_us: dict[str, int] = {}
        self.arrival_us: dict[str, int] = {}
        self._asked = None
        self._watch_defer()

    def _watch_defer(self):
        # Record what _should_defer_prefill answered, without replacing it: an instance attribute
        # that forwards to whatever the class holds now (stock or wrapped).
        loop = self

        def observed(running_batch):
            answer = type(loop.s)._should_defer_prefill(loop.s, running_batch)
            loop._asked = answer
            return answer

        self.s.__dict__["_should_defer_prefill"] = observed

    def submit(self, req):
        self.arrival_us[req.rid] = self.clock_us
        self.s.waiting_queue.append(req)
        req.arrival_processed_tokens = self.s.processed_tokens_counter

    def abort(self, rid: str):
        """The engine's own abort path (abort_request; the chunk teardown runs in the next step)."""
        from sglang.srt.managers.io_struct import AbortReq

        self.s.abort_request(AbortReq(rid=rid))

    def step(self) -> Step:
        s = self.s
        self._asked = None
        plan = s.get_next_batch_to_run(s.running_batch, s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        if batch is None:
            rec = Step("idle", ())
        elif batch.forward_mode.is_extend():
            spans = tuple((r.rid, p, e) for r, p, e in
                          zip(batch.reqs, batch.prefix_lens, batch.extend_lens))
            rows = list(plan.running_batch.reqs) + list(batch.decoding_reqs or ())
            rec = Step("extend", tuple(r.rid for r in batch.reqs), spans,
                       extend_pass_cost_us(batch),
                       rows=(len(rows), sum(r.seqlen for r in rows)))
        else:
            rows = batch.reqs
            rec = Step("decode", tuple(r.rid for r in rows), (),
                       model.step_cost_us(len(rows), sum(r.seqlen for r in rows)))
        rec.deferred = self._asked
        self.clock_us += rec.cost_us
        if batch is not None:
            self._commit(batch)
        s.last_batch = batch
        s.forward_ct += 1
        self.trace.append(rec)
        return rec

    def _commit(self, batch):
        """The result processor's bookkeeping for one token per row (no model output here)."""
        from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache

        tree = self.s.tree_cache
        if batch.forward_mode.is_extend():
            for req in batch.reqs:
                if (req.finished() and req.inflight_middle_chunks <= 0) or req.is_retracted:
                    continue
                if req.inflight_middle_chunks > 0:
                    req.inflight_middle_chunks -= 1       # a middle chunk: nothing to stream
                    continue
                req.output_ids.append(self.TOKEN)
                req.update_finish_state()
                self.first_token_us.setdefault(req.rid, self.clock_us)
                if req.finished():
                    release_kv_cache(req, tree, checkpoint=True)
                elif not batch.decoding_reqs or req not in batch.decoding_reqs:
                    checkpoint_kv_cache(req, tree)
            return
        for req in batch.reqs:
            if req.finished():
                continue
            req.output_ids.append(self.TOKEN)
            req.update_finish_state()
            if req.finished():
                release_kv_cache(req, tree, checkpoint=True)

    def run_until(self, predicate, limit: int = 100_000) -> int:
        for n in range(limit):
            if predicate():
                return n
            self.step()
        raise RuntimeError(f"loop did not reach its condition in {limit} steps")


# --- The A/B --------------------------------------------------------------------------------

def _one_run(*, stream_ctx: int, prompt: int, chunk: int, interval: int,
             backend: str, mixed_chunk: bool = False) -> dict:
    full = 2 * (stream_ctx + 4 * PAGE) + prompt + 8 * chunk
    s = build_scheduler(chunk=chunk, interval=interval, full_tokens=full, swa_tokens=16 * chunk,
                        req_slots=4, max_context_len=max(stream_ctx, prompt) + 4 * chunk,
                        backend=backend, mixed_chunk=mixed_chunk)
    loop = Loop(s)
    streams = [make_req(f"stream{i}", stream_ctx, max_new_tokens=1 << 30, salt=i + 1)
               for i in range(2)]
    for r in streams:
        loop.submit(r)
    # warm-up: both streams prefilled and decoding
    loop.run_until(lambda: all(len(r.output_ids) >= 2 for r in streams))
    t0, out0 = loop.clock_us, len(streams[0].output_ids)
    for _ in range(BEFORE_STEPS):
        loop.step()
    before_rate = (len(streams[0].output_ids) - out0) / (loop.clock_us - t0)
    before_step_us = (loop.clock_us - t0) // BEFORE_STEPS
    long_req = make_req("prompt500k", prompt, max_new_tokens=1, salt=99)
    loop.submit(long_req)
    start, out1, first = loop.clock_us, len(streams[0].output_ids), len(loop.trace)
    loop.run_until(lambda: long_req.rid in loop.first_token_us)
    during = loop.trace[first:]
    decode_steps = len(streams[0].output_ids) - out1
    ttft = loop.first_token_us[long_req.rid] - start
    chunks = [st for st in during if st.kind == "extend" and long_req.rid in st.rids]
    per_chunk, run = [], 0
    for st in during:
        if st.kind == "extend" and long_req.rid in st.rids:
            if st is not chunks[0]:
                per_chunk.append(run)
            run = 0
        elif st.kind == "decode":
            run += 1
    # stream tokens that rode in extend passes (mixed chunk only; 0 otherwise)
    in_extend = sum(1 for st in during if st.kind == "extend" and streams[0].rid in st.rids)
    return {"cadence": (decode_steps / ttft) / before_rate, "ttft_us": ttft,
            "chunks": len(chunks), "decode_steps": decode_steps,
            "rate_before_tok_s": round(before_rate * 1e6, 3),
            "rate_during_tok_s": round(decode_steps / ttft * 1e6, 3),
            "stream_tokens_in_extend_passes": in_extend,
            "decode_steps_between_chunks": {"min": min(per_chunk, default=0),
                                            "max": max(per_chunk, default=0),
                                            "total": sum(per_chunk)},
            "before_step_us": before_step_us, "idle_steps": sum(st.kind == "idle" for st in during)}


# The cluster's measured figures (SPEC), printed beside every modelled result.
CLUSTER_FIGURES = {"cadence_stock": 0.080, "cadence_yield": {"33": 0.393, "50": 0.524},
                   "first_token_ratio": {"33": 1.47, "50": 1.94}}


def _engine_loaded():
    """The engine's scheduler module importable on CPU (the harness's torchvision shim first)."""
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()
    import sglang.srt.managers.scheduler  # noqa: F401


def _install_yield(share: Optional[int]) -> None:
    """DSV41_DECODE_YIELD=share through the production installer (share None: the key unset,
    nothing installed); any other outcome is an error, not a run."""
    from adapter import installer

    state = installer.install_in_process({} if share is None else {model.KEY: str(share)})[model.NAME]
    if state.status != ("off" if share is None else "installed"):
        raise RuntimeError(f"decode_yield: unexpected install state {state.status}: {state.detail}")


def run_ab(share: Optional[int], *, stream_ctx: int = STREAM_CONTEXT, prompt: int = PROMPT_TOKENS,
           chunk: int = CHUNK, interval: int = INTERVAL, backend: str = "rust") -> dict:
    """Stock run, then the same loop with DSV41_DECODE_YIELD=share through the installer."""
    from adapter import installer

    _engine_loaded()
    kw = dict(stream_ctx=stream_ctx, prompt=prompt, chunk=chunk, interval=interval,
              backend=backend)
    installer.reset_for_tests()
    stock = _one_run(**kw)
    # the second run goes through the production installer; with the key unset it installs nothing
    try:
        _install_yield(share)
        with_yield = _one_run(**kw)
    finally:
        installer.reset_for_tests()
        installer.set_mode("boot")
    return {"share": share, "cadence_stock": round(stock["cadence"], 3),
            "cadence_yield": round(with_yield["cadence"], 3),
            "first_token_ratio": round(with_yield["ttft_us"] / stock["ttft_us"], 3),
            "steps": {"stock": stock, "yield": with_yield},
            "setup": {"streams": 2, "stream_context": stream_ctx, "prompt": prompt,
                      "chunk": chunk, "prefill_decode_interval": interval, "page": PAGE,
                      "tree_core": backend},
            "cluster": CLUSTER_FIGURES}


# --- The engine's own knobs beside the yield (`--alternatives`, issue 43) ------------------------

@dataclasses.dataclass(frozen=True)
class Alternative:
    """One change to the production line (--prefill-decode-interval 1, 8192-token chunks) that an
    operator would try instead of DSV41_DECODE_YIELD, or the yield itself."""
    name: str
    change: str                 # the launch change as written on the line ("" : built per run)
    interval: int = 1           # --prefill-decode-interval (the engine attribute the step reads)
    half_chunk: bool = False    # --chunked-prefill-size at half the run's chunk
    mixed_chunk: bool = False   # --enable-mixed-chunk (Scheduler.is_mixed_chunk)
    yield_share: bool = False   # DSV41_DECODE_YIELD at the run's --share, through the installer


ALTERNATIVES = (
    # the engine's own default (interval unset: off), the baseline upstream PR #40443 compares to
    Alternative("engine PDI 0", "--prefill-decode-interval 0 (engine default)", interval=0),
    Alternative("stock PDI 1", "none (the production line without the key)"),
    Alternative("PDI 8", "--prefill-decode-interval 8", interval=8),
    Alternative("PDI 16", "--prefill-decode-interval 16", interval=16),
    Alternative("mixed chunk", "--enable-mixed-chunk", mixed_chunk=True),
    Alternative("half chunk", "", half_chunk=True),
    Alternative("yield", "", yield_share=True),
)

MIXED_PRICING = ("mixed chunk: the engine's own mixed path runs (PrefillAdder with the running "
                 "rows' budget, ScheduleBatch.mix_with_running); its pass is priced by the sim: "
                 "chunk pass cost + per decode row the decode step's per-row and per-context terms "
                 "(extend_pass_cost_us). The cost model has no mixed form and was never fitted to "
                 "a mixed pass; under DSpark a mixed row is a plain 1-token decode (the engine's "
                 "speculative hook says so) where a decode step may accept more.")


def run_alternatives(*, share: Optional[int] = 33, stream_ctx: int = STREAM_CONTEXT,
                     prompt: int = PROMPT_TOKENS, chunk: int = CHUNK, backend: str = "rust",
                     names=None) -> dict:
    """One run per ALTERNATIVES row on fresh schedulers (the yield row through the production
    installer with DSV41_DECODE_YIELD=share; share None leaves that row out). Every row reads the
    same two streams and the same cold prompt; TTFT ratios are against the stock row."""
    from adapter import installer

    _engine_loaded()
    rows = []
    for alt in ALTERNATIVES:
        if (names is not None and alt.name not in names) or (alt.yield_share and share is None):
            continue
        run_chunk = chunk // 2 if alt.half_chunk else chunk
        change = alt.change
        if alt.half_chunk:
            change = f"--chunked-prefill-size {run_chunk}"
        if alt.yield_share:
            change = f"{model.KEY}={share}"
        try:
            if alt.yield_share:
                _install_yield(share)
            else:
                installer.reset_for_tests()
            run = _one_run(stream_ctx=stream_ctx, prompt=prompt, chunk=run_chunk,
                           interval=alt.interval, backend=backend, mixed_chunk=alt.mixed_chunk)
        finally:
            installer.reset_for_tests()
            installer.set_mode("boot")
        rows.append({
            "name": f"yield {share}" if alt.yield_share else alt.name,
            "change": change,
            "prefill_decode_interval": alt.interval, "chunk": run_chunk,
            "mixed_chunk": alt.mixed_chunk, "share": share if alt.yield_share else None,
            "cadence": round(run["cadence"], 3),
            "rate_during_tok_s": run["rate_during_tok_s"],
            "rate_before_tok_s": run["rate_before_tok_s"],
            "ttft_s": round(run["ttft_us"] / 1e6, 1),
            "chunks": run["chunks"],
            "decode_steps_between_chunks": run["decode_steps_between_chunks"],
            "stream_tokens_in_extend_passes": run["stream_tokens_in_extend_passes"],
            "clock": "sim-priced mixed pass" if alt.mixed_chunk else "cost model",
            "_ttft_us": run["ttft_us"],
        })
    stock_us = next((r["_ttft_us"] for r in rows if r["name"] == "stock PDI 1"), None)
    for r in rows:
        r["ttft_vs_stock"] = round(r["_ttft_us"] / stock_us, 3) if stock_us else None
        del r["_ttft_us"]
    return {"alternatives": rows,
            "setup": {"streams": 2, "stream_context": stream_ctx, "prompt": prompt, "chunk": chunk,
                      "page": PAGE, "tree_core": backend,
                      "clock": "adapter/decode_yield.py cluster constants " + model.CLUSTER.value()},
            "mixed_chunk_pricing": MIXED_PRICING,
            "cluster": CLUSTER_FIGURES}


def print_alternatives(result: dict) -> None:
    st = result["setup"]
    print(f"decode yield alternatives (modelled clock, the engine's real scheduler): 2 streams at "
          f"{st['stream_context']} tokens, cold {st['prompt']}-token prompt, {st['chunk']}-token "
          f"chunks unless the row changes them")
    print(f"{'line':<12}  {'change':<44}  {'cadence':>7}  {'tok/s during / before':>21}  "
          f"{'TTFT s':>6}  {'x stock':>7}  {'steps between chunks':>20}  {'in extend':>9}")
    for r in result["alternatives"]:
        gaps = r["decode_steps_between_chunks"]
        print(f"{r['name']:<12}  {r['change']:<44}  {r['cadence']:>7.3f}  "
              f"{r['rate_during_tok_s']:>9.2f} / {r['rate_before_tok_s']:>9.2f}  "
              f"{r['ttft_s']:>6.1f}  {r['ttft_vs_stock'] or 0:>7.3f}  "
              f"{gaps['min']:>5}..{gaps['max']:<4} ({gaps['total']:>5})  "
              f"{r['stream_tokens_in_extend_passes']:>9}")
    print(f"  {result['mixed_chunk_pricing']}")
    print("  cluster: 0.080 -> 0.393 (share 33), 0.524 (share 50); first token x1.47 / x1.94")


def _share(text: str) -> Optional[int]:
    if text.lower() in ("unset", "off", "none"):
        return None
    value = int(text)
    if not 1 <= value <= 99:
        raise argparse.ArgumentTypeError("share must be 1..99 or 'unset'")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="dsv41 sim yield", description=__doc__.split("\n\n")[0])
    p.add_argument("--share", type=_share, default=33,
                   help="DSV41_DECODE_YIELD for the yield run (1..99), or 'unset' (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--stream-context", type=int, default=STREAM_CONTEXT,
                   help=f"context length of each running stream (default {STREAM_CONTEXT})")
    p.add_argument("--prompt", type=int, default=PROMPT_TOKENS,
                   help=f"tokens of the cold prompt prefilled in chunks (default {PROMPT_TOKENS})")
    p.add_argument("--chunk", type=int, default=CHUNK, help=f"--chunked-prefill-size (default {CHUNK})")
    p.add_argument("--interval", type=int, default=INTERVAL,
                   help=f"--prefill-decode-interval (default {INTERVAL})")
    p.add_argument("--tree-core", choices=("rust", "python"), default="rust",
                   help="the radix cache's tree core (default %(default)s, the engine's)")
    p.add_argument("--alternatives", action="store_true",
                   help="one row per alternative to the yield: engine PDI 0, stock PDI 1, PDI 8, "
                        "PDI 16, mixed chunk, half chunk, yield at --share (interval per row; "
                        "--interval unused)")
    args = p.parse_args(argv)
    if args.alternatives:
        alt = run_alternatives(share=args.share, stream_ctx=args.stream_context,
                               prompt=args.prompt, chunk=args.chunk, backend=args.tree_core)
        if args.json:
            print(json.dumps(alt, indent=1, sort_keys=False))
        else:
            print_alternatives(alt)
        return 0
    result = run_ab(args.share, stream_ctx=args.stream_context, prompt=args.prompt,
                    chunk=args.chunk, interval=args.interval, backend=args.tree_core)
    if args.json:
        print(json.dumps(result, indent=1, sort_keys=False))
        return 0
    st, yd = result["steps"]["stock"], result["steps"]["yield"]
    print(f"decode yield sim: 2 streams at {args.stream_context} tokens, cold {args.prompt}-token "
          f"prompt in {args.chunk}-token chunks, --prefill-decode-interval {args.interval}")
    print(f"  share {result['share']}: cadence stock {result['cadence_stock']:.3f} -> yield "
          f"{result['cadence_yield']:.3f}; first token x{result['first_token_ratio']:.2f}")
    print(f"  stock: {st['chunks']} chunks, {st['decode_steps']} stream steps, "
          f"TTFT {st['ttft_us'] / 1e6:.1f} s (modelled)")
    print(f"  yield: {yd['chunks']} chunks, {yd['decode_steps']} stream steps, "
          f"TTFT {yd['ttft_us'] / 1e6:.1f} s; steps between chunks "
          f"{yd['decode_steps_between_chunks']['min']}..{yd['decode_steps_between_chunks']['max']}")
    print("  cluster: 0.080 -> 0.393 (share 33), 0.524 (share 50); first token x1.47 / x1.94")
    return 0


if __name__ == "__main__":
    sys.exit(main())
