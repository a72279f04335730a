"""decode yield (`DSV41_DECODE_YIELD=pct`, 1..99): running streams keep a share of a chunked prefill.

Between two chunks of a long chunked prefill the stock engine runs only `--prefill-decode-interval`
decode steps (the profile says 1), so the other streams fall to ~8 % of their rate for the whole
prefill. With the key set, after each NON-FINAL chunk of a chunked prompt, while decode rows are
running, the next chunk is deferred, through the engine's own `_should_defer_prefill` path, until
the running streams have had decode steps whose modelled time is worth pct/(100-pct) of that
pass's modelled time:

    steps = ceil(pct * pass_cost / ((100 - pct) * step_cost)), then min(steps, 128),
            then max(steps, --prefill-decode-interval)

What each hook does (nothing else changes):
- `Scheduler._arm_prefill_decode_interval(batch)` (the engine's arming point, called on the batch
  the step will run): runs the engine's arming unchanged, then notes a *candidate* when that batch
  is an extend pass carrying a non-final chunk (`scheduler.chunked_req` is one of its requests: the
  adder kept the request chunked, so more chunks follow). The candidate holds the pass's modelled
  cost from its `prefix_lens` / `extend_lens`.
- `Scheduler.get_next_batch_to_run`: runs the engine's step unchanged; if a candidate was noted,
  arms the yield from the plan's running batch (decode rows: `plan.running_batch.reqs` plus the
  mixed-chunk `batch.decoding_reqs`; their context lengths). Fewer rows than
  max(1, --prefill-decode-interval-min-bs): not armed (a lone prompt keeps stock behaviour).
- `Scheduler._should_defer_prefill(running_batch)`: while armed and the armed request is still the
  scheduler's chunked request and the running batch still has enough rows, it calls the engine's
  own method (which keeps the stock interval counter in step) and answers True: this step decodes.
  After `steps` such answers, or as soon as the streams finish / the chunked request is gone
  (aborted, cancelled: `process_pending_chunked_abort` clears `chunked_req`), it disarms and the
  engine's method answers alone.

Stock behaviour is kept exactly for the final chunk (no candidate: `chunked_req` is None after the
adder admitted the last chunk), a lone prompt (no rows), a single-pass prompt (never chunked) and
every step while not armed. The same chunks run in the same order and the same batches; only the
decode steps between chunks are more.

Determinism: every input is replicated scheduler state (chunk and prefix lengths, batch size,
context lengths of the decode rows, the configured interval); no clock and nothing rank-local is
read, so every TP rank defers alike. Under DP attention (`require_mlp_sync`) the engine keeps the
interval in step across DP ranks while the rows differ per rank, and under pipeline parallelism
the chunked request spans micro-batches: in both the yield is not applied (fallback line, stock
interval kept). A dLLM scheduler never calls `_should_defer_prefill`: fallback too.

Cost model: the cluster constants below, or the operator's own fit of their engine's scheduler
log (`dsv41 calibrate yield`) given as DSV41_DECODE_YIELD_MODEL (six integers, CostModel's
order); the installed line names the model in use. Every rank reads the same env.

Online calibration (`DSV41_DECODE_YIELD_ONLINE=1`): the rule and caps stay, the chunk and step
times come from the engine's own step counters. At each non-final chunk's arming the model is
level-scaled (the engine's prefill busy microseconds over the modelled cost of the extend passes
since the previous non-final chunk, else since boot; the mean timed decode step over the modelled
mean step, same windows); after the 2nd, 8th and 32nd deferral the plan is redone from the
chunk's own measured time and the decode steps timed since. Each reading is taken by every rank
from its own counters and agreed by one all-reduce (MAX, integer microseconds) over the
attention-TP group's gloo group at a step every rank reaches alike (the path to it reads
replicated state only), so every rank adopts the same plan at the same step. The per-prompt
achieved share (below) is not an input: it is computed after the prompt's last plan, for the line
and /metrics only.

Receipts: `[dsv41] decode_yield installed: ...` at install; one line per chunked prompt that
yielded, when it leaves chunked prefill: chunks yielded, decode steps planned and run, early ends.

On a contained exception (`internal error (<type>)`): only the yield's own state of that scheduler
is dropped (stock interval from then on); the engine's batch, queues and interval counter are as
its own step left them (each hook calls the engine first, or instead), so no answer changes.
"""
from __future__ import annotations

from typing import NamedTuple

from adapter import receipts, tp_group

# Counter keys in receipts.counters["decode_yield"] (series: adapter/metrics.py KEYS).
COUNTERS = {
    "chunks_yielded": "non-final chunks after which decode streams got yield steps",
    "steps_planned": "decode steps planned before the next chunk",
    "steps_deferred": "planned decode steps that ran (the chunk waited)",
    "ended_early_chunked_req_gone": "yields ended because the chunked prompt left (abort, retract)",
    "ended_early_streams_finished": "yields ended because the decode rows finished",
    "lone_chunks": "non-final chunks with too few decode rows to yield to",
    "achieved_share": "sum over measured yielded prompts of the share of time their decode "
                      "streams got (the engine's step timings; measured, never a decision input)",
    "share_measured": "yielded prompts whose achieved share was measured",
    "online_scales_agreed": "non-final chunks whose chunk / step time scales were read from the "
                            "engine's step timings and agreed over the TP group "
                            "(DSV41_DECODE_YIELD_ONLINE)",
    "online_replans": "plans redone from the chunk's measured time and the decode steps timed "
                      "since (DSV41_DECODE_YIELD_ONLINE)",
}

NAME = "decode_yield"
KEY = "DSV41_DECODE_YIELD"
MAX_STEPS = 128

# --- Cost model (integer microseconds of one TP4 forward on the cluster) ---------------------
# The one place the cluster constants live (CLUSTER below). Units: modelled microseconds of a
# forward of DeepSeek V4.1 Flash on the production cluster (4x DGX Spark GB10, TP4 over RoCE,
# fp8 KV, page 256).
# Where they come from (SPEC, "decode yield" and "Release evidence"):
# - Chunk: a fixed per-forward floor, a per-token term (MoE/MLP/projections) and an attention +
#   indexer term per (new token x visible token) pair. Fitted to the cluster's 1M needle: 969,071
#   cold tokens in 8192-token chunks took 195 s (the model gives 195.4 s). The split between the
#   per-token and the attention term is not measured; we put ~0.55 s on a chunk at prefix 0.
# - Decode step: a fixed floor, a per-row term and a per-context-token term (sparse attention
#   reads). The context term and the per-row term are guesses; the floor is fitted so that the
#   stock loop (interval 1: one decode step per chunk) gives the cluster's measured stream rate
#   of 0.080 of its rate before, during a cold 500K prefill beside two 300K streams.
MODEL_KEY = "DSV41_DECODE_YIELD_MODEL"
ONLINE_KEY = "DSV41_DECODE_YIELD_ONLINE"


class CostModel(NamedTuple):
    """The integer constants, in the order of DSV41_DECODE_YIELD_MODEL's value (six, or seven
    with the squared-prefix term)."""
    chunk_fixed_us: int        # per extend forward
    chunk_token_ns: int        # per prompt token of the pass, nanoseconds
    chunk_pair_ps: int         # per (new token x visible token) pair, picoseconds
    step_fixed_us: int         # per decode forward
    step_row_us: int           # per decode row
    step_ctx_ps: int           # per context token of the decode rows, picoseconds
    chunk_prefix_sq_ps: int = 0   # per squared prefix token of a request's extend, picoseconds

    def value(self) -> str:
        """The key's value for this model (what `dsv41 calibrate yield` prints): six integers, or
        seven when the squared-prefix term is not 0."""
        return ",".join(str(v) for v in (self if self.chunk_prefix_sq_ps else self[:6]))


CLUSTER = CostModel(20_000, 65_000, 277, 60_000, 3_000, 52_000)
# Any other engine, model, chunk size or cluster: fit its own model from its scheduler log
# (`dsv41 calibrate yield`, docs/decode_yield.md) and set DSV41_DECODE_YIELD_MODEL to it.


def chunk_cost_us(extend_len: int, prefix_len: int, model: CostModel = CLUSTER) -> int:
    """Modelled time of one request's extend of `extend_len` tokens after `prefix_len` cached.

    L·tok + L·(P + L/2)·pair + P²·sq. The pair term alone is a chunk whose attention reads what it
    can see (c·L·(P + L/2), the cluster's kernels); with sq = pair / 2 the two quadratic terms make
    (pair/2)·(P + L)², a backend whose chunk cost grows with the whole context squared (the CPU
    server's torch_native / SDPA extend), since (P + L)² = 2·L·(P + L/2) + P². The fit
    (`dsv41 calibrate yield`) picks the mix; the cluster constants keep sq = 0."""
    if extend_len <= 0:
        return 0
    pairs = extend_len * (prefix_len + extend_len // 2)
    return (extend_len * model.chunk_token_ns // 1000 + pairs * model.chunk_pair_ps // 1_000_000
            + prefix_len * prefix_len * model.chunk_prefix_sq_ps // 1_000_000)


def pass_cost_us(extend_lens, prefix_lens, model: CostModel = CLUSTER) -> int:
    """Modelled time of an extend pass (one forward over every request of the batch)."""
    return model.chunk_fixed_us + sum(chunk_cost_us(e, p, model)
                                      for e, p in zip(extend_lens, prefix_lens))


def step_cost_us(rows: int, context_tokens: int, model: CostModel = CLUSTER) -> int:
    """Modelled time of one decode step of `rows` rows holding `context_tokens` tokens in all."""
    return (model.step_fixed_us + rows * model.step_row_us
            + context_tokens * model.step_ctx_ps // 1_000_000)


def engine_timing(scheduler) -> tuple:
    """The engine's own step timings so far (`Scheduler._record_step_counters`): (prefill busy
    microseconds, decode steps timed, their microseconds). A decode step is timed launch to
    launch and only after another decode step (so the first decode step after a chunk is not);
    a prefill step launch to result. Read for the achieved-share measurement only, never for a
    decision."""
    totals = scheduler.decode_moment_totals
    return (int(scheduler.total_prefill_busy_us), int(totals[0]), float(totals[2]))


def achieved_share(start: tuple, end: tuple, decode_steps: int):
    """(share, decode_us, prefill_us) the decode streams got between two engine_timing()
    snapshots in which `decode_steps` decode steps ran, or (None, reason): the decode time is the
    engine's mean timed decode step of the window times the steps that ran (the engine does not
    time a decode step that follows a chunk; a window with no timed step, one step per chunk as
    at the stock interval, takes the mean of every step the engine timed so far), the prefill
    time the engine's prefill busy time."""
    prefill_us = end[0] - start[0]
    timed, timed_us = end[1] - start[1], end[2] - start[2]
    if decode_steps <= 0:
        return None, "no decode step ran"
    if timed <= 0 or timed_us <= 0:
        timed, timed_us = end[1], end[2]
    if timed <= 0 or timed_us <= 0:
        return None, "the engine has timed no decode step yet (none followed another)"
    decode_us = timed_us / timed * decode_steps
    if decode_us + prefill_us <= 0:
        return None, "no time recorded"
    return decode_us / (decode_us + prefill_us), decode_us, prefill_us


def wanted_steps(pct: int, pass_us: int, step_us: int) -> int:
    """Decode steps worth pct/(100-pct) of the pass, before the bounds: ceil, integers only."""
    if not 1 <= pct <= 99:
        raise ValueError(f"{KEY}={pct}: out of range 1..99")
    return -(-pct * pass_us // ((100 - pct) * max(step_us, 1)))


def yield_steps(pct: int, pass_us: int, step_us: int, interval: int) -> int:
    """Decode steps after a non-final chunk: worth pct/(100-pct) of the pass, in [interval, 128]."""
    return max(min(wanted_steps(pct, pass_us, step_us), MAX_STEPS), interval, 1)


# --- Online calibration (DSV41_DECODE_YIELD_ONLINE=1) -----------------------------------------

REPLAN_AT = (2, 8, 32)   # deferrals after which an online plan is redone from measured times


class OnlineScales:
    """One scheduler's online calibration: modelled costs summed per window, the closing window's
    readings of the engine's step counters, and the agreed scales.

    A window runs from one non-final chunk's arming to the next's: it holds the earlier chunk's
    pass and the decode steps after it. Each scale is a pair of integers (measured microseconds,
    modelled microseconds), identical on every rank once agreed; (1, 1) is the model as given.
    They price the chunk the step is about to run and its decode steps at its arming; once the
    chunk has run, its plan is redone from its own measured time (`replan`)."""
    __slots__ = ("boot", "start", "win_extend_us", "win_steps_us", "win_steps", "all_extend_us",
                 "all_steps_us", "all_steps", "closing", "chunk", "step")

    def __init__(self, boot=None):
        self.boot = boot           # engine_timing() when this calibration began (None: zeros)
        self.start = boot          # engine_timing() when the open window began
        self.win_extend_us = self.win_steps_us = self.win_steps = 0      # modelled, open window
        self.all_extend_us = self.all_steps_us = self.all_steps = 0      # modelled, since boot
        self.closing = None        # (readings, modelled sums) of the window closed this step
        self.chunk = (1, 1)        # agreed chunk time scale: measured us / modelled us
        self.step = (1, 1)         # agreed decode step scale: measured us / modelled us

    def note_batch(self, batch, model: CostModel) -> None:
        """Add the modelled cost of the batch the step will run (replicated state only)."""
        mode = batch.forward_mode
        if mode.is_extend():
            cost = pass_cost_us(batch.extend_lens, batch.prefix_lens, model)
            self.win_extend_us += cost
            self.all_extend_us += cost
        elif mode.is_decode():
            reqs = batch.reqs
            cost = step_cost_us(len(reqs), sum(r.seqlen for r in reqs), model)
            self.win_steps_us += cost
            self.all_steps_us += cost
            self.win_steps += 1
            self.all_steps += 1

    def close_window(self, now) -> None:
        """At a non-final chunk's arming: keep the closing window's readings (this rank's engine
        counters, `now` = engine_timing() or None) for the plan to agree, and open the next."""
        self.closing = (readings(self.boot, self.start, now),
                        (self.win_extend_us, self.win_steps_us, self.win_steps,
                         self.all_extend_us, self.all_steps_us, self.all_steps))
        self.start = now
        self.win_extend_us = self.win_steps_us = self.win_steps = 0

    def adopt(self, agreed: list, modelled: tuple) -> bool:
        """Take the agreed readings as the scales (the window's where it has them, else since
        boot; a scale with neither keeps its last value). True when a scale changed."""
        win_prefill, win_step, all_prefill, all_step = agreed
        win_ext, win_steps_us, win_steps, all_ext, all_steps_us, all_steps = modelled
        before = (self.chunk, self.step)
        if win_prefill > 0 and win_ext > 0:
            self.chunk = (win_prefill, win_ext)
        elif all_prefill > 0 and all_ext > 0:
            self.chunk = (all_prefill, all_ext)
        # mean measured step / mean modelled step = (mean x steps) / modelled sum
        if win_step > 0 and win_steps > 0:
            self.step = (win_step * win_steps, win_steps_us)
        elif all_step > 0 and all_steps > 0:
            self.step = (all_step * all_steps, all_steps_us)
        return (self.chunk, self.step) != before

    def scaled(self, pass_us: int, step_us: int) -> tuple:
        return (pass_us * self.chunk[0] // self.chunk[1],
                max(step_us * self.step[0] // self.step[1], 1))


_ZERO = (0, 0, 0.0)        # engine_timing() of an engine that has timed nothing yet


def since(start, now) -> list:
    """[prefill busy us, mean timed decode step us] between two engine_timing() snapshots of this
    rank (0 = none; either snapshot None: both 0)."""
    if start is None or now is None:
        return [0, 0]
    timed, timed_us = now[1] - start[1], now[2] - start[2]
    return [max(int(now[0] - start[0]), 0), int(timed_us / timed) if timed > 0 and timed_us > 0 else 0]


def readings(boot, start, now) -> list:
    """This rank's readings of the engine's step counters, integer microseconds, 0 = none:
    [prefill busy in the window, mean timed decode step in the window, prefill busy since the
    calibration began, mean timed decode step since then] (`boot` / `start` None: from zero)."""
    if now is None:
        return [0, 0, 0, 0]
    return since(start or _ZERO, now) + since(boot or _ZERO, now)


def agree(values: list) -> list:
    """Element-wise MAX of each rank's readings over the attention-TP group (a TP forward ends
    when its slowest rank does): every rank gets the same integers at the same step. One rank:
    its own."""
    group, size, _ = tp_group.engine_group()
    if group is None or size <= 1:
        return list(values)
    return tp_group.all_reduce_max(list(values), group)


# --- Per-scheduler state ---------------------------------------------------------------------
# Kept on the Scheduler instance (two schedulers in one process, as in the tests, never share it).
_STATE = "_dsv41_decode_yield"


class _State:
    __slots__ = ("cand_req", "cand_cost", "req", "left", "log", "timing", "online", "plan")

    def __init__(self):
        self.cand_req = None      # chunked request of the pass the engine just armed for
        self.cand_cost = 0        # that pass's modelled cost
        self.req = None           # armed: the chunked request whose next chunk waits
        self.left = 0             # armed: decode steps still owed before that chunk
        self.log = None           # per-prompt receipt: [req, chunks, planned, run, early_ends,
                                  #  chunks capped, online re-plans]
        self.timing = None        # engine_timing() when that prompt's first yield was armed
        self.online = None        # OnlineScales with DSV41_DECODE_YIELD_ONLINE=1
        self.plan = None          # online, armed: [engine_timing() at arming, deferrals done,
                                  #  planned steps, planned pass us, planned step us, capped]


def _state(scheduler) -> _State:
    st = scheduler.__dict__.get(_STATE)
    if st is None:
        st = scheduler.__dict__[_STATE] = _State()
    return st


def decisions(scheduler) -> dict:
    """Inspection for tests and the sim: what the yield holds for this scheduler now."""
    st = scheduler.__dict__.get(_STATE)
    if st is None:
        return {"armed": False, "left": 0}
    return {"armed": st.req is not None, "left": st.left,
            "rid": getattr(st.req, "rid", None)}


def _flush_log(st: _State, scheduler=None, pct: int = 0, counters=None) -> None:
    if st.log is None:
        return
    req, chunks, planned, run, early, capped, replans = st.log
    online = ""
    if st.online is not None:
        ol = st.online
        online = (f"; online scales at its last arming: chunk x{ol.chunk[0] / ol.chunk[1]:.3g}, "
                  f"decode step x{ol.step[0] / ol.step[1]:.3g}; {replans} plans redone from "
                  f"the chunk's measured time (agreed over the TP group)")
    start, st.log, st.timing = st.timing, None, None
    measured = "achieved share not measured (no engine step timings)"
    if start is not None and scheduler is not None:
        try:
            result = achieved_share(start, engine_timing(scheduler), run)
        except Exception as exc:  # noqa: BLE001 - a measurement only: the line says so
            result = (None, f"engine step timings unreadable ({type(exc).__name__})")
        if result[0] is None:
            measured = f"achieved share not measured ({result[1]})"
        else:
            share, decode_us, prefill_us = result
            measured = (f"achieved share {share:.2f} (configured {pct / 100:.2f}) by the engine's "
                        f"step timings: decode {decode_us / 1e6:.3f} s over {run} steps, prefill "
                        f"{prefill_us / 1e6:.3f} s")
            if counters is not None:
                counters["achieved_share"] += round(share, 4)
                counters["share_measured"] += 1
    # a chunk worth more than MAX_STEPS steps gets MAX_STEPS: the share falls short by design
    cap = f"; {capped} of {chunks} chunks capped at {MAX_STEPS} steps" if capped else ""
    receipts.line(NAME, "rid=%s left chunked prefill: %d chunks yielded, %d decode steps "
                  "planned, %d run, %d ended early; %s%s%s", req.rid, chunks, planned, run, early,
                  measured, cap, online)


def _unsupported(scheduler) -> str | None:
    if scheduler.require_mlp_sync:
        return ("DP attention (require_mlp_sync): the engine keeps the interval in step across "
                "DP ranks and their rows differ; stock interval kept")
    if scheduler.dllm_config is not None:
        return "dLLM scheduler: no _should_defer_prefill path; stock behaviour kept"
    from sglang.srt.runtime_context import get_parallel

    if get_parallel().pp_size > 1:
        return "pipeline parallelism: the chunked prompt spans micro-batches; stock interval kept"
    return None


def install(ctx) -> str:
    pct = ctx.value(KEY)
    if pct is None or not 1 <= pct <= 99:   # keys.py refuses these at parse time already
        raise ValueError(f"{KEY}={pct!r}: expected 1..99")
    counters = ctx.counters
    fitted = ctx.value(MODEL_KEY)       # keys.py parsed and range-checked it at boot
    model = CLUSTER if fitted is None else CostModel(*fitted)
    online = ctx.value(ONLINE_KEY) == 1

    def contain(scheduler, exc) -> None:
        """An exception of the yield's own logic: one fallback line, the yield state of this
        scheduler dropped (stock interval from here); the engine's step goes on."""
        ctx.fallback(f"internal error ({type(exc).__name__}); yield state dropped, stock "
                     "interval kept")
        st = scheduler.__dict__.get(_STATE)
        if st is not None:
            finish_plan(st)
            st.cand_req, st.cand_cost, st.req, st.left, st.log = None, 0, None, 0, None
            st.timing = None
            st.online = None      # the calibration restarts from the engine's counters as they are

    def finish_plan(st) -> None:
        """An online plan is counted when it is final (the yield of that chunk ended): a re-plan
        may lower it, and a Prometheus counter cannot go down."""
        plan, st.plan = st.plan, None
        if plan is None:
            return
        counters["steps_planned"] += plan[2]
        if st.log is not None:
            st.log[2] += plan[2]
            st.log[5] += plan[5]

    def timing_or_none(scheduler):
        """engine_timing(), or None where the engine keeps no step counters: the line then says
        "not measured", the online scales keep their value."""
        try:
            return engine_timing(scheduler)
        except Exception:  # noqa: BLE001 - a reading only; its absence is handled by its readers
            return None

    def online_scales(scheduler, st) -> OnlineScales:
        if st.online is None:
            st.online = OnlineScales(timing_or_none(scheduler))
        return st.online

    def arm_prefill_decode_interval(original, self, batch, *args, **kwargs):
        out = original(self, batch, *args, **kwargs)
        try:
            note_candidate(self, batch)
            if online and batch is not None:
                # after note_candidate: a candidate's own pass belongs to the window it opens
                online_scales(self, _state(self)).note_batch(batch, model)
        except Exception as exc:  # noqa: BLE001 - the adapter's own logic only
            contain(self, exc)
        return out

    def note_candidate(self, batch) -> None:
        chunked = self.chunked_req
        st = self.__dict__.get(_STATE)
        if st is not None and st.log is not None and st.log[0] is not chunked:
            # the prompt that yielded left chunked prefill (last chunk, abort)
            finish_plan(st)
            _flush_log(st, self, pct, counters)
        if (chunked is None or batch is None or chunked not in batch.reqs
                or not batch.forward_mode.is_extend()):
            return
        reason = _unsupported(self)
        if reason is not None:
            ctx.fallback(reason)
            return
        st = _state(self)
        st.cand_req = chunked
        st.cand_cost = pass_cost_us(batch.extend_lens, batch.prefix_lens, model)
        if online:
            online_scales(self, st).close_window(timing_or_none(self))

    def get_next_batch_to_run(original, self, *args, **kwargs):
        plan = original(self, *args, **kwargs)
        st = self.__dict__.get(_STATE)
        if st is None or st.cand_req is None:
            return plan
        try:
            arm(self, st, plan)
        except Exception as exc:  # noqa: BLE001 - the adapter's own logic only
            contain(self, exc)
        return plan

    def arm(self, st, plan) -> None:
        req, cost = st.cand_req, st.cand_cost
        st.cand_req, st.cand_cost = None, 0
        if online:
            # at every non-final chunk, before any return below: every rank reaches this line at
            # the same step (the path to it reads replicated state only), so the all-reduce in
            # agree() pairs up across the TP group
            ol = online_scales(self, st)
            closing, ol.closing = ol.closing, None
            measured, modelled = closing or ([0, 0, 0, 0], (0, 0, 0, 0, 0, 0))
            ol.adopt(agree(measured), modelled)
            counters["online_scales_agreed"] += 1
        batch = plan.batch_to_run
        if batch is None or req is not self.chunked_req or req not in batch.reqs:
            return        # the engine did not end up running that chunk this step
        rows = list(plan.running_batch.reqs)
        if batch.decoding_reqs:
            rows.extend(batch.decoding_reqs)
        if len(rows) < max(1, self.prefill_decode_interval_min_bs):
            counters["lone_chunks"] += 1
            return
        step = step_cost_us(len(rows), sum(r.seqlen for r in rows), model)
        if online:
            cost, step = st.online.scaled(cost, step)
        steps = yield_steps(pct, cost, step, self.prefill_decode_interval)
        finish_plan(st)          # a plan left armed (its chunk ran without a deferral call)
        if st.log is None or st.log[0] is not req:
            _flush_log(st, self, pct, counters)
            st.log = [req, 0, 0, 0, 0, 0, 0]
            st.timing = timing_or_none(self)   # measurement only (the line, /metrics)
        st.log[1] += 1
        counters["chunks_yielded"] += 1
        capped = wanted_steps(pct, cost, step) > MAX_STEPS
        if online:
            # at least the first re-plan point: the plan is redone there from the chunk's own time
            steps = max(steps, *REPLAN_AT[:1])
            st.plan = [timing_or_none(self), 0, steps, cost, step, capped]
        else:
            st.log[2] += steps
            st.log[5] += capped
            counters["steps_planned"] += steps
        st.req, st.left = req, steps

    def should_defer_prefill(original, self, running_batch, *args, **kwargs):
        st = self.__dict__.get(_STATE)
        if st is None or st.req is None:
            return original(self, running_batch, *args, **kwargs)
        try:
            if st.req is not self.chunked_req:
                early = "ended_early_chunked_req_gone"
            elif running_batch.batch_size() < max(1, self.prefill_decode_interval_min_bs):
                early = "ended_early_streams_finished"
            else:
                early = None
        except Exception as exc:  # noqa: BLE001 - the adapter's own logic only
            contain(self, exc)
            return original(self, running_batch, *args, **kwargs)
        if early is None:
            original(self, running_batch, *args, **kwargs)   # the stock counter runs alongside
            st.left -= 1
            counters["steps_deferred"] += 1
            if st.log is not None:
                st.log[3] += 1
            if st.plan is not None:
                st.plan[1] += 1
                if st.plan[1] in REPLAN_AT:
                    try:
                        replan(self, st)
                    except Exception as exc:  # noqa: BLE001 - the adapter's own logic only
                        contain(self, exc)
                        return True
            if st.left <= 0:
                finish_plan(st)
                st.req, st.left = None, 0
            return True
        counters[early] += 1
        if st.log is not None:
            st.log[4] += 1
        finish_plan(st)
        st.req, st.left = None, 0
        return original(self, running_batch, *args, **kwargs)

    def replan(self, st) -> None:
        """After the REPLAN_AT[i]-th deferral (the same step on every rank: the count is
        replicated): the plan redone from what the engine measured since the arming, agreed over
        the TP group: the chunk's own prefill time (it has run: its result is processed by the
        second step after it, with or without the overlap scheduler) and the mean decode step
        the engine has timed since; a reading none has keeps the arming's estimate."""
        start, done, _, pass_us, step_us, _ = st.plan
        chunk_read, step_read = agree(since(start, timing_or_none(self)))
        pass_us, step_us = chunk_read or pass_us, step_read or step_us
        steps = max(yield_steps(pct, pass_us, step_us, self.prefill_decode_interval), done)
        now_capped = wanted_steps(pct, pass_us, step_us) > MAX_STEPS
        st.left = steps - done
        st.plan = [start, done, steps, pass_us, step_us, now_capped]
        counters["online_replans"] += 1
        if st.log is not None:
            st.log[6] += 1

    ctx.around("Scheduler._arm_prefill_decode_interval", arm_prefill_decode_interval)
    ctx.around("Scheduler.get_next_batch_to_run", get_next_batch_to_run)
    ctx.around("Scheduler._should_defer_prefill", should_defer_prefill)
    return (f"{KEY}={pct}: after a non-final chunk with decode rows running, the next chunk waits "
            f"ceil({pct}/{100 - pct} x chunk cost / decode step cost) decode steps "
            f"(>= --prefill-decode-interval, <= {MAX_STEPS}); integer cost model, no clock; "
            + (f"cost model: cluster constants {CLUSTER.value()} ({MODEL_KEY} unset)" if fitted is None
               else f"cost model: {MODEL_KEY}={model.value()} (fitted)")
            + ("; online calibration: chunk and decode step times from the engine's own step "
               "timings (the model level-scaled at each non-final chunk, the plan redone from the "
               "chunk's measured time once it ran), agreed over the attention-TP group "
               f"({ONLINE_KEY}=1)" if online else ""))
