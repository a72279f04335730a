"""decode yield on the engine's real Scheduler step (in-process).

Every scheduling decision below is made by the pinned engine's own
`Scheduler.get_next_batch_to_run`, which calls its own `_should_defer_prefill` and
`_arm_prefill_decode_interval`, builds the real `PrefillAdder`, `ScheduleBatch` and `Req` objects
and allocates from the real UnifiedRadixCache (FULL+SWA) and pools (adapter/cpu/cpu_engine.py). The
adapter is installed through the production installer (tests/conftest.py `install_adapters`).

The Scheduler is built by adapter/tools/sims/decode_yield.py `build_scheduler` with object.__new__; its
docstring lists every attribute set and why. In short: the interval / chunked-prefill state that
init_chunked_prefill would set (chunked_req, prefill_decode_interval, its counter and min_bs,
chunk size, budgets); the real cache and pools; real collaborators built without a model
(SchedulePolicy, NewTokenRatioTracker, BeamCoordinator, SchedulerDPAttnAdapter,
NgramEmbeddingManager, GrammarManager with an empty queue, SchedulerLoadInquirer); every feature
switch the step reads, off (hicache, lmcache, hisparse, LoRA, priority, overlap, DP attention,
dLLM, delayers); and stand-ins only for what needs a GPU model or another process:
model_config (vocab size and two flags), tp_worker.model_runner (attn_backend,
prefill_aware_swa) and the tokenizer channel that abort outputs are sent on.

The forward pass cannot run here: `Loop` gives each batch its modelled cost and commits one
token per row the way the engine's result processor does (checkpoint / release of the KV).
"""
from __future__ import annotations

import ast
import json
import logging
import pathlib
import re
import time
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from adapter import decode_yield as dy
from adapter import receipts
from adapter.tools.sims import decode_yield as sim

CHUNK = 8192
PROMPT = 5 * CHUNK + 1000          # five full chunks and a short final one
KEY = "DSV41_DECODE_YIELD"


def _scheduler(**kw):
    kw.setdefault("full_tokens", 98_304)
    kw.setdefault("swa_tokens", 49_152)
    return sim.build_scheduler(chunk=CHUNK, req_slots=8, **kw)


def scenario(*, interval=1, streams=2, stream_len=1024, stream_new=1 << 20, prompt=PROMPT,
             extra=(), min_bs=0, tp_rank=0, until=None, on_step=None):
    """Streams decoding, then a cold chunked prompt "p" (and `extra` requests behind it).

    Returns (loop, trace from the prompt's arrival, stream requests, prompt request)."""
    loop = sim.Loop(_scheduler(interval=interval, min_bs=min_bs, tp_rank=tp_rank))
    rows = [sim.make_req(f"s{i}", stream_len, max_new_tokens=stream_new, salt=i + 1)
            for i in range(streams)]
    for r in rows:
        loop.submit(r)
    if rows:
        loop.run_until(lambda: all(len(r.output_ids) >= 2 for r in rows))
    mark = len(loop.trace)
    p = sim.make_req("p", prompt, max_new_tokens=1, salt=50)
    loop.submit(p)
    for r in extra:
        loop.submit(r)
    done = until or (lambda lp: "p" in lp.first_token_us and not lp.s.waiting_queue
                     and lp.s.chunked_req is None)
    for _ in range(5000):
        if done(loop):
            break
        loop.step()
        if on_step is not None:
            on_step(loop)
    else:
        raise AssertionError("scenario did not finish")
    return loop, loop.trace[mark:], rows, p


def shape(trace):
    return [(st.kind, st.rids, st.spans, st.deferred) for st in trace]


def chunk_gaps(trace, rid="p"):
    """(extend step, decode steps after it, their modelled time) for each chunk of `rid` but the last."""
    out, cur = [], None
    for st in trace:
        if st.kind == "extend" and rid in st.rids:
            if cur is not None:
                out.append(tuple(cur))
            cur = [st, 0, 0]
        elif cur is not None and st.kind == "decode":
            cur[1] += 1
            cur[2] += st.cost_us
    return out


def extends(trace):
    return [(st.rids, st.spans) for st in trace if st.kind == "extend"]


ROWS = ("get_next_batch_to_run", "_should_defer_prefill", "_arm_prefill_decode_interval")


def _hooked(cls) -> set:
    """Rows whose class attribute is a HookRegistry wrapper (not the engine's own function)."""
    return {name for name in ROWS
            if cls.__dict__[name].__code__.co_filename.endswith("hook_registry.py")}


def counters():
    return dict(receipts.counters[dy.NAME])


@pytest.fixture
def yield_on(install_adapters):
    def _on(pct):
        state = install_adapters({KEY: str(pct)})[dy.NAME]
        assert state.status == "installed", state.detail
        assert state.pin_ok is True
        return state
    return _on


# --- stock behaviour with the key unset -------------------------------------------------

@pytest.mark.parametrize("interval", [1, 2])
def test_stock_trace_unchanged_with_key_unset(install_adapters, interval):
    from sglang.srt.managers.scheduler import Scheduler

    status = install_adapters({})
    assert status[dy.NAME].status == "off"
    assert not _hooked(Scheduler)
    loop, trace, _, _ = scenario(interval=interval)
    gaps = chunk_gaps(trace)
    assert len(gaps) == 5
    # the engine's own cadence: exactly `interval` decode steps between two chunks
    assert [n for _, n, _ in gaps] == [interval] * 5
    assert dy.decisions(loop.s)["armed"] is False
    # the same run after an install/undo cycle is identical: the undo restores the stock methods
    install_adapters({KEY: "33"})
    assert _hooked(Scheduler) == set(ROWS)
    install_adapters({})
    assert not _hooked(Scheduler)
    _, again, _, _ = scenario(interval=interval)
    assert shape(again) == shape(trace)


# --- shares ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pct", [33, 50])
def test_share_sets_decode_steps_between_chunks(yield_on, pct, caplog):
    yield_on(pct)
    before = counters()
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        loop, trace, streams, p = scenario()
    gaps = chunk_gaps(trace)
    assert len(gaps) == 5
    for ext, steps, decode_us in gaps:
        rows, ctx = ext.rows
        assert rows == 2
        expected = dy.yield_steps(pct, ext.cost_us, dy.step_cost_us(rows, ctx), 1)
        assert steps == expected
        assert 1 < steps < dy.MAX_STEPS
        # the streams got at least pct/(100-pct) of the chunk's modelled time...
        assert decode_us * (100 - pct) >= pct * ext.cost_us
        # ...and one step fewer would not have been enough
        assert (steps - 1) * dy.step_cost_us(rows, ctx) * (100 - pct) < pct * ext.cost_us
    after = counters()
    assert after.get("chunks_yielded", 0) - before.get("chunks_yielded", 0) == 5
    assert after.get("steps_deferred", 0) - before.get("steps_deferred", 0) == \
        sum(n for _, n, _ in gaps)
    assert dy.decisions(loop.s)["armed"] is False
    assert len(p.output_ids) == 1 and p.finished()
    # one receipt line for the prompt, when its last chunk was armed: its chunks and steps
    steps = sum(n for _, n, _ in gaps)
    assert _yield_lines(caplog) == [f"rid=p left chunked prefill: 5 chunks yielded, {steps} decode "
                                    f"steps planned, {steps} run, 0 ended early"]


def _yield_lines(caplog):
    """decode_yield's per-prompt receipt lines, their decisions: without the '[dsv41] decode_yield '
    prefix and without the achieved share that ends them (a measurement, tested on its own below)."""
    return [m.split("[dsv41] decode_yield ", 1)[1].split("; achieved share", 1)[0]
            for m in (r.getMessage() for r in caplog.records) if "[dsv41] decode_yield rid=" in m]


def test_share_50_yields_more_than_33(yield_on):
    yield_on(33)
    _, t33, _, _ = scenario()
    yield_on(50)
    _, t50, _, _ = scenario()
    n33 = [n for _, n, _ in chunk_gaps(t33)]
    n50 = [n for _, n, _ in chunk_gaps(t50)]
    assert all(b > a for a, b in zip(n33, n50))


def test_chunk_identity_same_chunks_same_order_only_delayed(install_adapters, yield_on):
    short = [sim.make_req("q", 300, max_new_tokens=3, salt=60)]
    install_adapters({})
    _, stock, _, _ = scenario(extra=short)
    yield_on(33)
    short = [sim.make_req("q", 300, max_new_tokens=3, salt=60)]
    _, with_yield, _, _ = scenario(extra=short)
    # the same prefill passes, same requests, same spans, same order
    assert extends(with_yield) == extends(stock)
    # six chunks of p; q rides with the short final chunk
    assert len(extends(stock)) == 6 and extends(stock)[-1][0] == ("p", "q")
    # every decode batch holds the same rows as stock's decode batches at that point
    def decode_rows(trace):
        out, seen = [], 0
        for st in trace:
            if st.kind == "extend":
                seen += 1
            elif st.kind == "decode":
                out.append((seen, st.rids))
        return sorted(set(out))
    assert decode_rows(with_yield) == decode_rows(stock)
    # only delayed: more decode steps between the chunks, never fewer
    assert all(y >= s for (_, s, _), (_, y, _) in zip(chunk_gaps(stock), chunk_gaps(with_yield)))
    assert sum(st.kind == "decode" for st in with_yield) > sum(st.kind == "decode" for st in stock)


# --- stock behaviour kept: lone prompt, final chunk, single pass -----------------------------

def test_lone_prompt_keeps_stock_behaviour(install_adapters, yield_on):
    install_adapters({})
    _, stock, _, _ = scenario(streams=0)
    yield_on(33)
    before = counters()
    loop, with_yield, _, _ = scenario(streams=0)
    assert shape(with_yield) == shape(stock)
    # the stock interval with min_bs 0 idles one step between chunks; kept as is
    assert [st.kind for st in stock[:3]] == ["extend", "idle", "extend"]
    assert counters().get("chunks_yielded", 0) == before.get("chunks_yielded", 0)
    assert counters().get("lone_chunks", 0) - before.get("lone_chunks", 0) == 5


def test_final_chunk_and_single_pass_keep_stock_behaviour(install_adapters, yield_on):
    """After the final chunk, and around a prompt that fits one pass, the trace is stock's."""
    def run():
        q = sim.make_req("q", 2000, max_new_tokens=4, salt=61)      # one pass: never chunked
        r = sim.make_req("r", 500, max_new_tokens=4, salt=62)
        # a final chunk that fills the pass, so q and r come in their own (single) pass
        return scenario(extra=[q, r], prompt=6 * CHUNK,
                        until=lambda lp: all(x.finished() for x in (q, r)))

    install_adapters({})
    _, stock, _, _ = run()
    yield_on(33)
    loop, with_yield, _, _ = run()

    def after_final(trace):
        final = max(i for i, st in enumerate(trace) if st.kind == "extend" and "p" in st.rids)
        return shape(trace[final:])
    tail = after_final(with_yield)
    assert tail == after_final(stock)
    assert tail[0][0] == "extend" and tail[1] == ("decode", ("s0", "s1"), (), True)
    single = [i for i, (k, rids, _, _) in enumerate(tail) if k == "extend" and "q" in rids]
    assert len(single) == 1 and tail[single[0]][1] == ("q", "r")
    assert tail[single[0] + 1][0] == "decode" and tail[single[0] + 1][3] is True
    assert dy.decisions(loop.s)["armed"] is False


# --- ends early ------------------------------------------------------------------------------

def test_abort_mid_prefill_ends_the_yield(yield_on, caplog):
    caplog.set_level(logging.INFO, logger=receipts.LOGGER_NAME)
    yield_on(50)
    before = counters()
    seen = {}

    def abort_in_second_deferral(loop):
        chunks = sum(st.kind == "extend" and "p" in st.rids for st in loop.trace)
        state = dy.decisions(loop.s)
        if chunks == 2 and state["armed"] and state["left"] <= 4 and "at" not in seen:
            seen["at"], seen["left"] = len(loop.trace), state["left"]
            loop.abort("p")                      # the engine's own abort_request

    q = sim.make_req("q", 300, max_new_tokens=2, salt=63)
    loop, trace, streams, p = scenario(extra=[q], on_step=abort_in_second_deferral,
                                       until=lambda lp: "q" in lp.first_token_us)
    assert seen and seen["left"] > 0
    after_abort = loop.trace[seen["at"]:]
    # the step right after the abort request: process_pending_chunked_abort drops the chunked
    # request, the yield ends at once and q is admitted instead of the owed decode steps
    assert after_abort[0].kind == "extend" and after_abort[0].rids == ("q",)
    assert p.finished() and loop.s.chunked_req is None
    assert [st for st in loop.trace if st.kind == "extend" and "p" in st.rids][-1].spans[0][1] \
        == CHUNK
    assert any(rid == "p" for _, rid in loop.s.ipc_channels.send_to_tokenizer.sent)
    assert dy.decisions(loop.s)["armed"] is False
    after = counters()
    assert after.get("ended_early_chunked_req_gone", 0) - \
        before.get("ended_early_chunked_req_gone", 0) == 1
    # p's KV went back: only the streams and q hold request slots now
    assert not p.kv.holds_kv
    # p's receipt line (flushed when q's pass was armed): 2 chunks yielded, the second one's
    # steps cut short by the abort (planned > run), one early end
    [line] = _yield_lines(caplog)
    m = re.fullmatch(r"rid=p left chunked prefill: 2 chunks yielded, (\d+) decode steps planned, "
                     r"(\d+) run, 1 ended early", line)
    assert m and int(m.group(1)) - int(m.group(2)) == seen["left"], (line, seen)


def test_streams_finishing_end_the_yield(yield_on):
    yield_on(50)
    before = counters()
    # the streams' last tokens land in the middle of the first deferral
    loop, trace, streams, p = scenario(stream_new=6)
    gaps = chunk_gaps(trace)
    assert gaps[0][1] < dy.yield_steps(50, gaps[0][0].cost_us,
                                       dy.step_cost_us(*gaps[0][0].rows), 1)
    assert all(r.finished() for r in streams)
    # no decode rows left: the next chunk follows at once, the later chunks are lone chunks
    first_gap_end = trace.index(gaps[1][0])
    assert trace[first_gap_end - 1].kind in ("decode", "idle")
    after = counters()
    assert after.get("ended_early_streams_finished", 0) - \
        before.get("ended_early_streams_finished", 0) == 1
    assert after.get("lone_chunks", 0) - before.get("lone_chunks", 0) == 4


# --- rank invariance -------------------------------------------------------------------------

def test_two_ranks_fed_the_same_state_decide_alike(yield_on, monkeypatch):
    """Rank 0 on the real clock; rank 3 with every clock of the time module skewed and slowed.

    Same inputs -> the same batches, the same defer answers, the same steps per chunk."""
    yield_on(33)
    _, rank0, _, _ = scenario(tp_rank=0)
    base = time.time()
    real = {name: getattr(time, name) for name in
            ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns")}
    calls = {"n": 0}

    def skewed(name):
        def clock():
            calls["n"] += 1
            value = real[name]()
            return value * 3 + (10**15 if name.endswith("_ns") else 10**6)
        return clock
    for name in real:
        monkeypatch.setattr(time, name, skewed(name))
    _, rank3, _, _ = scenario(tp_rank=3)
    monkeypatch.undo()
    assert time.time() - base < 10**5
    assert shape(rank3) == shape(rank0)
    assert [n for _, n, _ in chunk_gaps(rank3)] == [n for _, n, _ in chunk_gaps(rank0)]
    assert calls["n"] > 0          # the engine itself read the (skewed) clock; the decisions did not


def test_adapter_reads_no_clock_and_nothing_rank_local():
    """The adapter module imports nothing that could differ per rank (clock, randomness, env)."""
    tree = ast.parse(pathlib.Path(dy.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    # numpy / scipy.optimize: the online chunk fit (NNLS of agreed readings: no clock, no rank)
    assert imported <= {"__future__", "typing", "adapter", "sglang.srt.runtime_context", "numpy",
                        "scipy.optimize"}, imported
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"tp_rank", "attn_tp_rank", "dp_rank", "gpu_id", "environ"}


@settings(max_examples=200, deadline=None)
@given(pct=hs.integers(1, 99), pass_us=hs.integers(0, 10**8), step_us=hs.integers(1, 10**7),
       interval=hs.integers(0, 200))
def test_yield_steps_bounds_and_minimality(pct, pass_us, step_us, interval):
    n = dy.yield_steps(pct, pass_us, step_us, interval)
    assert n == dy.yield_steps(pct, pass_us, step_us, interval)
    assert n >= max(interval, 1)
    assert n <= max(interval, dy.MAX_STEPS)
    if max(interval, 1) < n < dy.MAX_STEPS:
        assert n * step_us * (100 - pct) >= pct * pass_us > (n - 1) * step_us * (100 - pct)


def test_cost_model_is_integer_and_monotone():
    assert isinstance(dy.pass_cost_us([CHUNK], [10**5]), int)
    assert isinstance(dy.step_cost_us(2, 600_000), int)
    assert dy.pass_cost_us([CHUNK], [400_000]) > dy.pass_cost_us([CHUNK], [0])
    assert dy.pass_cost_us([CHUNK], [0]) > dy.pass_cost_us([CHUNK // 2], [0])
    assert dy.step_cost_us(4, 600_000) > dy.step_cost_us(2, 600_000) > dy.step_cost_us(2, 1000)
    # the calibration targets the constants were fitted to (see the comment in adapter/decode_yield.py)
    needle, pos = 0, 0
    while pos < 969_071:
        n = min(CHUNK, 969_071 - pos)
        needle += dy.pass_cost_us([n], [pos])
        pos += n
    assert 190e6 < needle < 200e6
    for bad in (0, 100, -1):
        with pytest.raises(ValueError):
            dy.yield_steps(bad, 1, 1, 1)


# --- configurations where the yield does not apply ------------------------------------------

def test_dp_attention_falls_back_to_the_stock_interval(yield_on):
    """With require_mlp_sync the engine's _arm_prefill_decode_interval keeps DP ranks in step;
    the yield stays out (fallback line) and the engine's own arming still happens."""
    yield_on(33)
    loop = sim.Loop(_scheduler(interval=1))
    for i in range(2):
        loop.submit(sim.make_req(f"s{i}", 1024, max_new_tokens=1 << 20, salt=i + 1))
    loop.run_until(lambda: all(len(r.output_ids) >= 2 for r in loop.s.running_batch.reqs)
                   and loop.s.running_batch.batch_size() == 2)
    loop.submit(sim.make_req("p", PROMPT, max_new_tokens=1, salt=50))
    loop.step()                                           # first chunk, armed as usual
    assert dy.decisions(loop.s)["armed"] is True
    batch = loop.s.last_batch
    before = counters()
    loop.s.__dict__.pop("_dsv41_decode_yield")
    loop.s.require_mlp_sync = True
    batch.is_extend_in_batch = True                       # what the DP gather would have set
    loop.s._prefill_decode_interval_remaining = 0
    loop.s._arm_prefill_decode_interval(batch)
    assert loop.s._prefill_decode_interval_remaining == 1  # the engine armed its interval
    assert dy.decisions(loop.s)["armed"] is False
    assert "_dsv41_decode_yield" not in loop.s.__dict__ or \
        loop.s.__dict__["_dsv41_decode_yield"].cand_req is None
    [reason] = [k for k in counters() if k.startswith("fallback:DP attention")]
    assert counters()[reason] - before.get(reason, 0) == 1


def test_min_bs_is_honoured(yield_on):
    """--prefill-decode-interval-min-bs 3 with two streams: the engine admits prefill every
    round below it, and the yield does not arm either."""
    yield_on(33)
    _, trace, _, _ = scenario(min_bs=3)
    assert [n for _, n, _ in chunk_gaps(trace)] == [0] * 5


# --- the sim's JSON --------------------------------------------------------------------------

def test_sim_json_fields_small(capsys):
    """`dsv41 sim yield --json` (scaled down): the fields the issue names, and the A/B direction."""
    argv = ["--share", "50", "--json", "--stream-context", "12000", "--prompt", str(4 * CHUNK)]
    assert sim.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"share", "cadence_stock", "cadence_yield", "first_token_ratio", "steps"} <= set(out)
    assert out["share"] == 50
    # four chunks, three gaps: the first token lands right after the last chunk, so the window
    # holds one chunk more than gaps and the cadence sits below the share at this small scale
    assert out["cadence_yield"] > 0.35 > 0.15 > out["cadence_stock"]
    assert 1.0 < out["first_token_ratio"] < 2.5
    assert out["steps"]["stock"]["chunks"] == out["steps"]["yield"]["chunks"] == 4
    assert out["steps"]["stock"]["decode_steps_between_chunks"]["max"] == 1


# --- achieved share: measured from the engine's step timings (logs and /metrics only) ----------

def _feed_engine_timings(loop):
    """After each step, the engine's step counters as `Scheduler._record_step_counters` keeps them,
    on the modelled clock: a prefill step adds its own time to total_prefill_busy_us; a decode step
    is timed launch to launch and only after another decode step (so it times the decode step
    before it), through the engine's own _accumulate_decode_moment."""
    from sglang.srt.managers.scheduler import _accumulate_decode_moment

    s, trace = loop.s, loop.trace
    if not hasattr(s, "decode_moment_totals"):
        s.total_prefill_busy_us, s.decode_moment_totals = 0, [0.0] * 6
    cur = trace[-1]
    if cur.kind == "extend":
        s.total_prefill_busy_us += cur.cost_us
    elif cur.kind == "decode" and len(trace) > 1 and trace[-2].kind == "decode":
        _accumulate_decode_moment(s.decode_moment_totals, len(cur.rids), trace[-2].cost_us, len(cur.rids))


def _modelled_share(trace, rid="p"):
    """Decode time over decode + chunk time from the prompt's first chunk to its last chunk's
    arrival (the window the adapter measures), on the modelled clock."""
    first = next(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    last = max(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    window = trace[first:last]
    decode = sum(st.cost_us for st in window if st.kind == "decode")
    chunks = sum(st.cost_us for st in window if st.kind == "extend")
    return decode / (decode + chunks)


@pytest.mark.parametrize("pct", [33, 50])
def test_achieved_share_line_measures_the_engine_timings(yield_on, caplog, pct):
    """With the engine's step counters following the modelled clock, the per-prompt line's achieved
    share is the modelled share of the window (decode steps of nearly equal cost: the engine's mean
    timed step stands for each), and the counters behind dsv41_decode_yield_achieved_share add it."""
    yield_on(pct)
    receipts.forget(dy.NAME)
    import logging
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        loop, trace, _, _ = scenario(on_step=_feed_engine_timings,
                                     until=lambda lp: "p" in lp.first_token_us and lp.s.chunked_req is None
                                     and any(" left chunked prefill" in r.getMessage() for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records if " left chunked prefill" in r.getMessage()]
    assert len(lines) == 1, lines
    import re
    m = re.search(r"achieved share (\d\.\d\d) \(configured (\d\.\d\d)\) by the engine's step timings", lines[0])
    assert m, lines[0]
    assert m.group(2) == f"{pct / 100:.2f}"
    assert abs(float(m.group(1)) - _modelled_share(trace)) <= 0.01
    c = counters()
    assert c["share_measured"] == 1
    assert abs(c["achieved_share"] - _modelled_share(trace)) <= 0.01


def test_achieved_share_is_never_a_decision_input(yield_on, monkeypatch):
    """Engine timings fed or absent, or made absurd: the same batches and the same steps per chunk."""
    yield_on(33)
    _, plain, _, _ = scenario()
    _, fed, _, _ = scenario(on_step=_feed_engine_timings)

    def absurd(loop):
        _feed_engine_timings(loop)
        loop.s.total_prefill_busy_us *= 7
        loop.s.decode_moment_totals[2] += 10**9
    _, odd, _, _ = scenario(on_step=absurd)
    assert shape(fed) == shape(plain) == shape(odd)


def test_achieved_share_function():
    # 3 decode steps ran, the engine timed 2 of them (200 ms in all), 2 s of prefill
    share, decode_us, prefill_us = dy.achieved_share((1_000, 4, 50.0), (2_001_000, 6, 200_050.0), 3)
    assert (decode_us, prefill_us) == (300_000.0, 2_000_000)
    assert share == pytest.approx(300_000 / 2_300_000)
    assert dy.achieved_share((0, 0, 0.0), (10, 0, 0.0), 1) == (
        None, "the engine has timed no decode step yet (none followed another)")
    # one step per chunk (the stock interval): no step of the window is timed; the mean of the
    # steps timed before it (40 steps, 400 ms) stands for them
    share, decode_us, _ = dy.achieved_share((0, 40, 400_000.0), (990_000, 40, 400_000.0), 1)
    assert decode_us == 10_000.0 and share == pytest.approx(0.01)
    assert dy.achieved_share((0, 0, 0.0), (10, 3, 9.0), 0) == (None, "no decode step ran")


# --- online calibration (DSV41_DECODE_YIELD_ONLINE=1) ------------------------------------------
# A "machine" whose chunks take chunk_x times the cost model's time and whose decode steps take
# step_x times it: the engine's step counters are fed from that machine's clock, the decisions
# still see only the model and (with the key) the agreed readings.

def _feed_machine(chunk_x, step_x, chunk_us=None):
    """The engine's step counters fed from a machine whose chunks take chunk_x times the model's
    time (or `chunk_us(step)`, a cost of another shape) and whose decode steps step_x times it."""
    from sglang.srt.managers.scheduler import _accumulate_decode_moment

    def feed(loop):
        s, trace = loop.s, loop.trace
        if not hasattr(s, "decode_moment_totals"):
            s.total_prefill_busy_us, s.decode_moment_totals = 0, [0.0] * 6
        cur = trace[-1]
        if cur.kind == "extend":
            s.total_prefill_busy_us += chunk_us(cur) if chunk_us else int(cur.cost_us * chunk_x)
        elif cur.kind == "decode" and len(trace) > 1 and trace[-2].kind == "decode":
            _accumulate_decode_moment(s.decode_moment_totals, len(cur.rids),
                                      int(trace[-2].cost_us * step_x), len(cur.rids))
    return feed


def _machine_share(trace, chunk_x, step_x, rid="p"):
    """The streams' share of the prompt's chunked-prefill window on the machine's clock."""
    first = next(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    last = max(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    decode = sum(st.cost_us for st in trace[first:last] if st.kind == "decode") * step_x
    chunks = sum(st.cost_us for st in trace[first:last] if st.kind == "extend") * chunk_x
    return decode / (decode + chunks)


@pytest.fixture
def online_on(install_adapters):
    def _on(pct, online="1"):
        env = {KEY: str(pct)}
        if online is not None:
            env[dy.ONLINE_KEY] = online
        state = install_adapters(env)[dy.NAME]
        assert state.status == "installed", state.detail
        return state
    return _on


@pytest.mark.parametrize("chunk_x,step_x", [(3.0, 0.4), (1.5, 0.5), (1.0, 1.0)])
def test_online_calibration_lands_the_share_where_the_model_is_off(online_on, chunk_x, step_x):
    """On a machine whose chunk / step times are off the model's by chunk_x / step_x, the online
    scales bring the streams' share within 0.05 of 33 %; the control without the key (the model as
    given) lands where the machine puts it, far off unless the model fits (1.0, 1.0). (A machine
    whose chunk is worth only a few decode steps overshoots by the rule's ceil, online or not: 2
    steps where 1.2 were worth the share.)"""
    online_on(33)
    receipts.forget(dy.NAME)
    _, trace, _, _ = scenario(on_step=_feed_machine(chunk_x, step_x))
    online = _machine_share(trace, chunk_x, step_x)
    assert abs(online - 0.33) <= 0.05, online
    # one agreement per non-final chunk (the prompt's, and the streams' none: single passes)
    c = counters()
    assert c["online_scales_agreed"] == len(chunk_gaps(trace))
    # a plan is counted once final (a re-plan may lower it): planned = run, every chunk
    assert c["steps_planned"] == c["steps_deferred"] == sum(n for _, n, _ in chunk_gaps(trace))
    assert c["online_replans"] >= len(chunk_gaps(trace))
    online_on(33, online=None)
    _, fixed_trace, _, _ = scenario(on_step=_feed_machine(chunk_x, step_x))
    fixed = _machine_share(fixed_trace, chunk_x, step_x)
    if (chunk_x, step_x) == (1.0, 1.0):
        assert shape(fixed_trace) == shape(trace)      # the model fits: the scales are 1
    else:
        assert abs(fixed - 0.33) > 0.15, fixed           # the negative control: the model alone misses


def _feed_quadratic_machine(k_ps=4_500, step_x=1.0):
    """A machine whose chunk cost is attention over the whole context, k·((P + L)² − P²) per
    request (the CPU server's torch_native shape), nothing like the cluster constants' shape
    (mostly per token); decode steps step_x x the model's."""
    def chunk_us(st):
        return sum(k_ps * ((p + n) ** 2 - p * p) // 1_000_000 for _, p, n in st.spans)

    feed = _feed_machine(None, step_x, chunk_us)
    feed.chunk_us = chunk_us
    return feed


def _quadratic_share(trace, feed, step_x=1.0, rid="p"):
    first = next(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    last = max(i for i, st in enumerate(trace) if st.kind == "extend" and rid in st.rids)
    decode = sum(st.cost_us for st in trace[first:last] if st.kind == "decode") * step_x
    chunks = sum(feed.chunk_us(st) for st in trace[first:last] if st.kind == "extend")
    return decode / (decode + chunks)


def test_online_replan_follows_a_chunk_cost_of_another_shape(online_on, monkeypatch):
    """The machine's chunks grow with the whole context squared while the model's barely grow
    with the prefix: the arming's level scale (from the chunk before) lags every chunk (the
    control: no re-plan), the plan redone from each chunk's measured time follows it."""
    feed = _feed_quadratic_machine()
    prompt = 9 * CHUNK + 1000
    online_on(33)
    _, fitted, _, _ = scenario(prompt=prompt, on_step=feed)
    with_fit = _quadratic_share(fitted, feed)
    monkeypatch.setattr(dy, "REPLAN_AT", ())      # the arming's level-scaled estimate only
    _, level, _, _ = scenario(prompt=prompt, on_step=feed)
    level_only = _quadratic_share(level, feed)
    # the modelled clock is deterministic: each chunk priced from the one before it alone is
    # always one growth step behind
    assert abs(with_fit - 0.33) <= 0.015, (with_fit, level_only)
    assert level_only < 0.31, (with_fit, level_only)


def test_the_line_counts_the_chunks_the_cap_cut(online_on, caplog):
    """A machine whose chunks are worth far more than 128 steps (chunks 20x the model's, steps
    0.5x): every plan is capped, the share falls short, and the prompt's line says so."""
    import logging

    online_on(33)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        _, trace, _, _ = scenario(on_step=_feed_machine(20.0, 0.5))
    gaps = [n for _, n, _ in chunk_gaps(trace)]
    assert gaps and all(n == dy.MAX_STEPS for n in gaps[1:]), gaps
    assert _machine_share(trace, 20.0, 0.5) < 0.28
    line = [r.getMessage() for r in caplog.records if " left chunked prefill" in r.getMessage()][-1]
    capped = sum(n == dy.MAX_STEPS for n in gaps)
    assert f"; {capped} of {len(gaps)} chunks capped at 128 steps; online scales" in line, line
    assert "plans redone from the chunk's measured time" in line, line


def test_online_with_no_engine_timings_keeps_the_model(online_on):
    """No step counters to read (a scheduler without them): every scale stays 1, the plans are the
    model's own, and the plan is still counted as agreed (the all-reduce ran)."""
    online_on(33, online=None)
    _, fixed, _, _ = scenario()
    online_on(33)
    _, online, _, _ = scenario()
    assert shape(online) == shape(fixed)


def test_online_scales_adopt_the_window_else_since_boot():
    ol = dy.OnlineScales()
    # window: 3 s of prefill over 1 s modelled; mean step 20 ms over a modelled mean of 40 ms
    assert ol.adopt([3_000_000, 20_000, 9_000_000, 50_000], (1_000_000, 400_000, 10, 4_000_000, 800_000, 20))
    assert ol.chunk == (3_000_000, 1_000_000) and ol.step == (200_000, 400_000)
    assert ol.scaled(500_000, 60_000) == (1_500_000, 30_000)
    # no window readings: since boot (9 s over 4 s; 50 ms x 20 over 0.8 s)
    ol.adopt([0, 0, 9_000_000, 50_000], (1_000_000, 400_000, 10, 4_000_000, 800_000, 20))
    assert ol.chunk == (9_000_000, 4_000_000) and ol.step == (1_000_000, 800_000)
    # nothing at all: the last scales stay
    assert not ol.adopt([0, 0, 0, 0], (0, 0, 0, 0, 0, 0))
    assert ol.chunk == (9_000_000, 4_000_000)
    assert dy.readings(None, (100, 2, 40.0), (400, 6, 240.0)) == [300, 50, 400, 40]
    assert dy.readings(None, None, None) == [0, 0, 0, 0]
    assert dy.since((100, 2, 40.0), (400, 6, 240.0)) == [300, 50]
    assert dy.since(None, (400, 6, 240.0)) == dy.since((0, 0, 0.0), None) == [0, 0]


# runs after conftest.TWO_RANKS_PREAMBLE (rank, mode, out, dist, tests/ on the path)
ONLINE_CHILD = r"""
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter import decode_yield as dy, installer, tp_group
import test_decode_yield as t

installer.set_mode("report")
state = installer.install_in_process({"DSV41_DECODE_YIELD": "33", "DSV41_DECODE_YIELD_ONLINE": "1"})
assert state["decode_yield"].status == "installed", state["decode_yield"].detail
group = dist.new_group([0, 1], backend="gloo")
tp_group.engine_group = lambda: (group, 2, rank)
if mode == "local":                     # the agreement replaced by each rank's own readings
    dy.agree = lambda values: list(values)
# the same batches on both ranks; rank 0 reads its chunks 3x the model's time, rank 1 1.2x
_, trace, _, _ = t.scenario(on_step=t._feed_machine(3.0 if rank == 0 else 1.2, 1.0))
json.dump({"gaps": [n for _, n, _ in t.chunk_gaps(trace)]}, open(out, "w"))
dist.destroy_process_group()
"""


# ONLINE_CHILD's imports, once per rank (conftest.run_two_ranks_modes forks a child per mode)
ONLINE_PRELOAD = """
import sys
sys.path.insert(0, "tests")
from adapter.cpu import cpu_engine
cpu_engine.install_torchvision_shim()
from adapter import decode_yield, installer, tp_group
import test_decode_yield
"""


def test_online_scales_are_agreed_over_the_tp_group(tmp_path):
    """Two ranks whose own step counters differ plan the same decode steps after every chunk
    (the slowest rank's readings, agreed); the control, each rank on its own readings, splits."""
    from conftest import run_two_ranks_modes

    runs = run_two_ranks_modes(ONLINE_CHILD, tmp_path, ["agree", "local"], ONLINE_PRELOAD)
    r0, r1 = runs["agree"]
    assert r0["gaps"] == r1["gaps"], (r0, r1)
    l0, l1 = runs["local"]
    assert l0["gaps"] == r0["gaps"]                  # rank 0's readings are the MAX
    assert l1["gaps"] != l0["gaps"], (l0, l1)        # on its own, rank 1 plans fewer steps


def test_model_form_follows_both_chunk_cost_shapes():
    """sq = 0: c*L*(P + L/2) (the cluster form, unchanged); sq = pair/2: (pair/2)*(P + L)^2 up to
    integer rounding (a backend whose chunk cost grows with the whole context squared)."""
    old = dy.CostModel(0, 0, 40_000, 1, 0, 0)
    sq = dy.CostModel(0, 0, 40_000, 1, 0, 0, 20_000)
    for L, P in ((4096, 0), (4096, 8192), (4096, 20480), (2048, 22528), (256, 100_000)):
        assert dy.chunk_cost_us(L, P, old) == L * (P + L // 2) * 40_000 // 1_000_000
        whole = (P + L) ** 2 * 20_000 / 1_000_000
        assert abs(dy.chunk_cost_us(L, P, sq) - whole) <= 2
    assert dy.CLUSTER.chunk_prefix_sq_ps == 0 and dy.CLUSTER.value() == "20000,65000,277,60000,3000,52000"


def test_calibrate_fit_recovers_either_shape():
    """The chunk fit (dsv41 calibrate yield's) on chunk times of either shape picks the matching
    mix, with no residual left."""
    from adapter.tools import calibrate as C

    pts = [(4096, p) for p in range(0, 24576, 4096)] + [(2048, 22528), (1024, 12288)]
    for times, want in (([1e-12 * 40_000 * L * (P + L / 2) for L, P in pts], (40_000, 0)),
                        ([1e-12 * 20_000 * (P + L) ** 2 for L, P in pts], (40_000, 20_000))):
        r = C._fit([(1.0, L, L * (P + L / 2), P * P) for L, P in pts], times,
                   ("fixed", "per token", "per pair", "per squared prefix token"), relative=False)
        assert r["rms_rel_residual"] < 0.01
        pair, sq = r["coef"][2] * 1e12, r["coef"][3] * 1e12
        assert abs(pair - want[0]) <= 0.01 * want[0] and abs(sq - want[1]) <= 0.01 * max(want[0], 1)


# --- the hooks' decisions, called directly ---------------------------------------------------
# install() through the installer's real InstallContext; the three hooks are then called with
# a scheduler / batch / plan holding only the attributes the hooks read (each hook calls the
# engine's method first, recorded here), so every branch of the planner is reached, including
# the mixed-chunk rows and a fitted cost model (found by bench/mutation.py).

MODEL = "0,0,26766,1048,1388,576320"        # docs/decode_yield.md's fitted example


class _Mode:
    def __init__(self, extend):
        self.extend = extend

    def is_extend(self):
        return self.extend


def _r(rid, seqlen=1000):
    return types.SimpleNamespace(rid=rid, seqlen=seqlen)


def _hooks(env):
    from adapter import installer, keys

    receipts.forget(dy.NAME)
    ctx = installer.InstallContext(dy.NAME, keys.parse_env(env))
    line = dy.install(ctx)
    by = {target.rsplit(".", 1)[1]: hook for target, hook in ctx.hooks.items()}
    return line, by["_arm_prefill_decode_interval"], by["get_next_batch_to_run"], \
        by["_should_defer_prefill"]


def _sched(chunked, min_bs=0, interval=1):
    """The engine's Scheduler as the sim builds it (small pools: the hooks read its chunked
    request, interval, min_bs and feature switches), with `chunked` as its chunked request."""
    s = sim.build_scheduler(chunk=CHUNK, req_slots=8, full_tokens=4 * CHUNK, swa_tokens=2 * CHUNK,
                            interval=interval, min_bs=min_bs)
    s.chunked_req = chunked
    return s


def _extend_batch(reqs, extend=(4096,), prefix=(8192,), mode=True, decoding=None):
    return types.SimpleNamespace(reqs=list(reqs), forward_mode=_Mode(mode), extend_lens=list(extend),
                                 prefix_lens=list(prefix), decoding_reqs=decoding)


def _plan(batch, rows):
    return types.SimpleNamespace(batch_to_run=batch, running_batch=types.SimpleNamespace(reqs=list(rows)))


@pytest.fixture
def pp1():
    """The published topology the yield reads (pp_size): one pipeline stage, set on the engine's
    own parallel context for the test (`get_parallel().override`)."""
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(pp_size=1):
        yield get_parallel


def _armed_steps(env, rows, decoding=None, min_bs=0):
    """Note a candidate, run get_next_batch_to_run: the steps armed (0: not armed)."""
    _, arm_hook, next_hook, _ = _hooks(env)
    p = _r("p")
    s = _sched(p, min_bs=min_bs)
    batch = _extend_batch([p], decoding=decoding)
    arm_hook(lambda self, b: None, s, batch)
    next_hook(lambda self: _plan(batch, rows), s)
    return dy.decisions(s)["left"]


def test_cost_model_values_and_install_lines():
    assert dy.CLUSTER.value() == "20000,65000,277,60000,3000,52000"
    assert dy.step_cost_us(1, 10 ** 6) == 60_000 + 3_000 + 52_000
    assert dy.chunk_cost_us(0, 100) == 0 and dy.chunk_cost_us(-1, 100) == 0
    assert dy.chunk_cost_us(1, 0) == 65                          # 1 token: 65 us, no pair term
    assert dy.chunk_cost_us(2, 0) == 130                         # pairs 2 x 1: 554 ps, floored
    with pytest.raises(ValueError, match=r"^DSV41_DECODE_YIELD=0: out of range 1\.\.99$"):
        dy.yield_steps(0, 1000, 1000, 1)
    line, *_ = _hooks({KEY: "33"})
    assert line.endswith("cost model: cluster constants 20000,65000,277,60000,3000,52000 "
                         "(DSV41_DECODE_YIELD_MODEL unset)")
    line, *_ = _hooks({KEY: "33", dy.MODEL_KEY: MODEL})
    assert line.endswith(f"cost model: DSV41_DECODE_YIELD_MODEL={MODEL} (fitted)")


@pytest.mark.parametrize("pct, ok", [(0, False), (1, True), (99, True), (100, False), (None, False)])
def test_install_refuses_a_share_outside_1_to_99(pct, ok):
    """keys.py refuses these at parse time; install() checks again (a ctx built otherwise)."""
    from adapter import installer, keys

    ctx = installer.InstallContext(dy.NAME, keys.parse_env({}))
    ctx.settings = types.SimpleNamespace(get=lambda name: pct if name == KEY else None)
    if ok:
        assert dy.install(ctx).startswith(f"{KEY}={pct}: ")
    else:
        with pytest.raises(ValueError, match=rf"^{KEY}={pct!r}: expected 1\.\.99$"):
            dy.install(ctx)


def test_a_fitted_model_plans_the_steps(pp1):
    model = dy.CostModel(*map(int, MODEL.split(",")))
    rows = [_r("s0", 3000), _r("s1", 5000)]
    want = dy.yield_steps(50, dy.pass_cost_us([4096], [8192], model),
                          dy.step_cost_us(2, 8000, model), 1)
    cluster = dy.yield_steps(50, dy.pass_cost_us([4096], [8192]), dy.step_cost_us(2, 8000), 1)
    assert want != cluster
    assert _armed_steps({KEY: "50", dy.MODEL_KEY: MODEL}, rows) == want
    assert _armed_steps({KEY: "50"}, rows) == cluster


def test_rows_count_the_mixed_chunk_decoding_requests_and_min_bs(pp1):
    env = {KEY: "50"}
    one = [_r("s0")]
    assert _armed_steps(env, one) > 0                               # one row: max(1, 0) rows
    assert _armed_steps(env, one, min_bs=2) == 0                    # too few rows: a lone chunk
    assert _armed_steps(env, one, decoding=[_r("m0")], min_bs=2) > 0   # + the mixed-chunk row
    assert receipts.counters[dy.NAME]["lone_chunks"] == 0           # (counters of the last run)
    with_mixed = dy.yield_steps(50, dy.pass_cost_us([4096], [8192]), dy.step_cost_us(2, 2000), 1)
    assert _armed_steps(env, one, decoding=[_r("m0")]) == with_mixed


def test_candidate_rules_and_what_reaches_the_engine(pp1):
    """Only an extend pass carrying the scheduler's chunked request notes a candidate; the
    engine's methods get every argument and their answers are returned."""
    _, arm_hook, next_hook, defer_hook = _hooks({KEY: "50"})
    p, q = _r("p"), _r("q")
    calls = []

    def engine(*args, **kwargs):
        calls.append((args[2:], kwargs))
        return "engine's answer"

    for sched, batch in ((_sched(None), _extend_batch([p])),            # no chunked request
                         (_sched(p), None),                              # no batch
                         (_sched(p), _extend_batch([q])),                # chunked not in the batch
                         (_sched(p), _extend_batch([p], mode=False))):   # not an extend pass
        assert arm_hook(engine, sched, batch, "x", k=1) == "engine's answer"
        assert dy.decisions(sched) == {"armed": False, "left": 0}
        assert _dy_state(sched) is None
    assert calls == [(("x",), {"k": 1})] * 4
    assert not [k for k in receipts.counters[dy.NAME] if k.startswith("fallback:")]
    # a candidate: noted, not armed yet (decisions say so), the engine's deferral answers alone
    s = _sched(p)
    batch = _extend_batch([p])
    arm_hook(lambda self, b: None, s, batch)
    st = _dy_state(s)
    assert st.cand_req is p and st.cand_cost == dy.pass_cost_us([4096], [8192])
    assert (st.req, st.left, st.log) == (None, 0, None)
    assert dy.decisions(s) == {"armed": False, "left": 0, "rid": None}
    rb = types.SimpleNamespace(batch_size=lambda: 2)
    assert defer_hook(lambda self, b, *a, **k: "stock", s, rb) == "stock"
    assert not any(receipts.counters[dy.NAME].values())
    # the plan ran another batch, another chunked request, or without p: not armed
    for plan, chunked in ((_plan(None, [q]), p), (_plan(batch, [q]), q),
                          (_plan(_extend_batch([q]), [q]), p)):
        arm_hook(lambda self, b: None, s, batch)
        s.chunked_req = chunked
        assert next_hook(lambda self, *a, **k: plan, s, "y", k=2) is plan
        assert (st.cand_req, st.cand_cost, st.req) == (None, 0, None)
        s.chunked_req = p
    # armed: the deferral calls the engine's method (its counter runs) and answers True
    arm_hook(lambda self, b: None, s, batch)
    next_hook(lambda self: _plan(batch, [q]), s)
    assert dy.decisions(s) == {"armed": True, "left": st.left, "rid": "p"} and st.left > 1
    seen = []
    assert defer_hook(lambda self, b, *a, **k: seen.append((a, k)) or False, s, rb, "z", k=3) is True
    assert seen == [(("z",), {"k": 3})]


def _dy_state(sched):
    return sched.__dict__.get(dy._STATE)


@pytest.mark.parametrize("where", ["note", "arm", "defer"])
def test_an_exception_of_the_yield_is_contained_and_drops_its_state(pp1, monkeypatch, where):
    _, arm_hook, next_hook, defer_hook = _hooks({KEY: "50"})
    p = _r("p")
    s = _sched(p)
    batch = _extend_batch([p])
    if where == "note":
        monkeypatch.setattr(dy, "pass_cost_us", lambda *a: 1 / 0)
    arm_hook(lambda self, b: None, s, batch)
    if where == "arm":
        monkeypatch.setattr(dy, "step_cost_us", lambda *a: 1 / 0)
    assert next_hook(lambda self: _plan(batch, [_r("q")]), s) is not None
    rb = types.SimpleNamespace(batch_size=lambda: 1 / 0 if where == "defer" else 1)
    seen = []
    assert defer_hook(lambda *a, **k: seen.append((a, k)) or "stock", s, rb, "z", k=3) == "stock"
    assert seen == [((s, rb, "z"), {"k": 3})]               # the engine's method, its arguments
    st = _dy_state(s)
    if st is not None:
        assert (st.cand_req, st.cand_cost, st.req, st.left, st.log) == (None, 0, None, 0, None)
    assert receipts.counters[dy.NAME]["fallback:internal error (ZeroDivisionError); yield state "
                                      "dropped, stock interval kept"] == 1


@pytest.mark.parametrize("attr, value, reason", [
    ("dllm_config", object(), "dLLM scheduler: no _should_defer_prefill path; stock behaviour kept"),
    ("pp_size", 2, "pipeline parallelism: the chunked prompt spans micro-batches; stock interval kept"),
])
def test_dllm_and_pipeline_parallel_keep_the_stock_interval(pp1, monkeypatch, attr, value, reason):
    _, arm_hook, _, _ = _hooks({KEY: "50"})
    p = _r("p")
    s = _sched(p)
    if attr == "pp_size":
        with pp1().override(pp_size=value):
            arm_hook(lambda self, b: None, s, _extend_batch([p]))
    else:
        setattr(s, attr, value)
        arm_hook(lambda self, b: None, s, _extend_batch([p]))
    assert _dy_state(s) is None
    assert receipts.counters[dy.NAME][f"fallback:{reason}"] == 1


def test_cost_functions_exact_values():
    """Integer arithmetic at values where a changed divisor or operand shows."""
    assert dy.chunk_cost_us(1000, 500) == 65_000 + 277          # 1e6 pairs x 277 ps = 277 us
    m = dy.CostModel(1, 2_000, 1_000_000, 0, 0, 0)
    # 1 + (1000 x 2 us + 1000 x (500 + 500) pairs x 1 us) + (10 x 2 us + 10 x 5 pairs x 1 us)
    assert dy.pass_cost_us([1000, 10], [500, 0], m) == 1 + (2_000 + 1_000_000) + (20 + 50)
    assert dy.pass_cost_us([], [], m) == 1


def test_deferral_counts_ends_and_passes_arguments(pp1, caplog):
    """_should_defer_prefill while armed: True until the planned steps ran (then disarmed), an
    early end per reason (counted, logged in the prompt's receipt line), the engine's method
    called with every argument on every path; a second prompt after the first one's line."""
    _, arm_hook, next_hook, defer_hook = _hooks({KEY: "50"})
    p, q = _r("p"), _r("q")
    s = _sched(p)
    batch = _extend_batch([p])
    seen = []

    def engine(self, rb, *args, **kwargs):
        seen.append((self, rb, args, kwargs))
        return "stock"

    rb = types.SimpleNamespace(batch_size=lambda: 1)
    assert defer_hook(engine, s, rb, "z", k=3) == "stock"            # not armed: the engine alone
    assert seen.pop() == (s, rb, ("z",), {"k": 3})
    got = []
    arm_hook(lambda self, b: None, s, batch)
    assert next_hook(lambda self, *a, **k: got.append((a, k)) or _plan(batch, [q]), s, "y", k=2)
    assert got == [(("y",), {"k": 2})]
    left = dy.decisions(s)["left"]
    c = receipts.counters[dy.NAME]
    assert c["chunks_yielded"] == 1 and c["steps_planned"] == left > 1
    for _ in range(left):                    # one row, min_bs 0: every planned step defers
        assert defer_hook(engine, s, rb, "z", k=3) is True
    assert seen == [(s, rb, ("z",), {"k": 3})] * left and c["steps_deferred"] == left
    assert dy.decisions(s) == {"armed": False, "left": 0, "rid": None}
    # the next chunk: armed again, both counters add up; the rows finish at once (twice)
    arm_hook(lambda self, b: None, s, batch)
    next_hook(lambda self: _plan(batch, [q]), s)
    assert c["chunks_yielded"] == 2 and c["steps_planned"] == 2 * left
    gone = types.SimpleNamespace(batch_size=lambda: 0)
    seen.clear()
    assert defer_hook(engine, s, gone, "z", k=3) == "stock"
    assert seen == [(s, gone, ("z",), {"k": 3})] and c["ended_early_streams_finished"] == 1
    assert dy.decisions(s) == {"armed": False, "left": 0, "rid": None}
    arm_hook(lambda self, b: None, s, batch)
    next_hook(lambda self: _plan(batch, [q]), s)
    assert defer_hook(engine, s, gone) == "stock" and c["ended_early_streams_finished"] == 2
    # min_bs 2 with 2 rows still defers
    s.prefill_decode_interval_min_bs = 2
    arm_hook(lambda self, b: None, s, batch)
    next_hook(lambda self: _plan(batch, [q, _r("q2")]), s)
    assert defer_hook(engine, s, types.SimpleNamespace(batch_size=lambda: 2)) is True
    # p leaves chunked prefill: its line, then q is a chunked prompt of its own
    s.chunked_req = q
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        assert defer_hook(engine, s, rb) == "stock" and c["ended_early_chunked_req_gone"] == 1
        arm_hook(lambda self, b: None, s, _extend_batch([q]))
    line = [m for m in (r.getMessage() for r in caplog.records) if "rid=p left chunked prefill" in m]
    assert line and line[0].split("; achieved share", 1)[0].endswith(f"rid=p left chunked prefill: 4 chunks yielded, "
                                     f"{c['steps_planned']} decode steps planned, {left + 1} run, "
                                     "3 ended early")
    assert _dy_state(s).cand_req is q
    next_hook(lambda self: _plan(_extend_batch([q]), [p, _r("q2")]), s)
    assert dy.decisions(s)["rid"] == "q" and _dy_state(s).log[:2] == [q, 1]
    assert not [k for k in c if k.startswith("fallback:")]


def test_installed_line_states_the_share():
    line, *_ = _hooks({KEY: "33"})
    assert line.startswith("DSV41_DECODE_YIELD=33: after a non-final chunk with decode rows running, "
                           "the next chunk waits ceil(33/67 x chunk cost / decode step cost) decode "
                           "steps (>= --prefill-decode-interval, <= 128)")
