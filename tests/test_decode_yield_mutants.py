"""decode yield's decisions at their edges (the mutation check's survivors of adapter/decode_yield.py,
docs/testing.md): the online calibration's sums, windows, adoption and scaling; the readings
between two engine-timing snapshots; the agreement over a TP group; the achieved-share measurement
and the per-prompt line that reports it; the cost model's zero-length extend; the DP-attention
fallback. On the engine's real Scheduler (the sim's construction), ScheduleBatch, Req and
ForwardMode, and a real gloo group."""
from __future__ import annotations

import collections
import logging
import re

import pytest

from adapter import decode_yield as dy
from adapter import receipts, tp_group
from adapter.tools.sims import decode_yield as sim

# a model whose every term is easy to follow: 1 ms per pass + 2 us per prompt token; a decode
# step 500 us + 100 us per row (no pair, context or squared-prefix term)
MODEL = dy.CostModel(1_000, 2_000, 0, 500, 100, 0)


def _batch(mode, reqs, extend=(), prefix=()):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    b = ScheduleBatch(reqs=list(reqs))
    b.forward_mode = mode
    b.extend_lens, b.prefix_lens = list(extend), list(prefix)
    return b


def _reqs(n, tokens=100):
    return [sim.make_req(f"r{i}", tokens, max_new_tokens=4, salt=i + 1) for i in range(n)]


# --- the online calibration ----------------------------------------------------------------------

def test_a_new_calibration_starts_from_its_boot_reading_with_nothing_summed():
    ol = dy.OnlineScales()
    assert (ol.boot, ol.start, ol.closing) == (None, None, None)
    assert (ol.win_extend_us, ol.win_steps_us, ol.win_steps) == (0, 0, 0)
    assert (ol.all_extend_us, ol.all_steps_us, ol.all_steps) == (0, 0, 0)
    assert (ol.chunk, ol.step) == ((1, 1), (1, 1))
    boot = (100, 2, 40.0)
    ol = dy.OnlineScales(boot)
    assert ol.boot == ol.start == boot


def test_batches_are_summed_per_window_and_since_boot_with_the_given_model():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    boot = (100, 2, 40.0)
    ol = dy.OnlineScales(boot)
    extend = _batch(ForwardMode.EXTEND, _reqs(2), extend=(100, 50), prefix=(0, 10))
    decode = _batch(ForwardMode.DECODE, _reqs(3))
    # the pass: 1,000 + 2 x 150 = 1,300 us; a step of 3 rows: 500 + 300 = 800 us (MODEL, not the
    # cluster constants: 20,000 + 65 x 150 and 60,000 + 3 x 3,000 + ...)
    for b in (extend, decode, extend, decode):
        ol.note_batch(b, MODEL)
    assert (ol.win_extend_us, ol.win_steps_us, ol.win_steps) == (2_600, 1_600, 2)
    assert (ol.all_extend_us, ol.all_steps_us, ol.all_steps) == (2_600, 1_600, 2)
    first = (400, 6, 240.0)
    ol.close_window(first)
    # readings of the closing window: [prefill, mean step] in it, and since the calibration began
    assert ol.closing == ([300, 50, 300, 50], (2_600, 1_600, 2, 2_600, 1_600, 2))
    assert ol.start == first and (ol.win_extend_us, ol.win_steps_us, ol.win_steps) == (0, 0, 0)
    for b in (extend, decode):
        ol.note_batch(b, MODEL)
    assert (ol.win_extend_us, ol.win_steps_us, ol.win_steps) == (1_300, 800, 1)
    assert (ol.all_extend_us, ol.all_steps_us, ol.all_steps) == (3_900, 2_400, 3)
    ol.close_window((1_000, 10, 640.0))
    # this window from `first`: 600 us of prefill, 4 steps in 400 us; since boot 900 us, 8 in 600
    assert ol.closing == ([600, 100, 900, 75], (1_300, 800, 1, 3_900, 2_400, 3))
    ol.close_window(None)                   # a scheduler without step counters: no readings
    assert ol.closing[0] == [0, 0, 0, 0] and ol.start is None


def _preset():
    ol = dy.OnlineScales()
    ol.chunk, ol.step = (7, 3), (5, 2)
    return ol


@pytest.mark.parametrize("agreed, modelled, chunk, step", [
    # the window's readings, each 1: adopted
    ([1, 1, 0, 0], (1, 1, 1, 0, 0, 0), (1, 1), (1, 1)),
    # the window modelled no pass / no step: its readings cannot scale anything; none since boot
    ([5, 4, 0, 0], (0, 8, 0, 0, 0, 0), (7, 3), (5, 2)),
    # no window readings: since boot, each 1
    ([0, 0, 1, 1], (0, 0, 0, 1, 1, 1), (1, 1), (1, 1)),
    # since boot modelled no pass / no step: the last scales stay
    ([0, 0, 5, 4], (0, 0, 0, 0, 8, 0), (7, 3), (5, 2)),
])
def test_a_scale_is_adopted_only_from_readings_with_a_modelled_cost(agreed, modelled, chunk, step):
    ol = _preset()
    assert ol.adopt(agreed, modelled) == ((chunk, step) != ((7, 3), (5, 2)))
    assert (ol.chunk, ol.step) == (chunk, step)


def test_scaled_costs_are_integers_floored_and_a_step_is_at_least_1_us():
    ol = dy.OnlineScales()
    ol.chunk, ol.step = (3, 2), (3, 2)
    assert ol.scaled(5, 7) == (7, 10)                       # 7.5 and 10.5, floored
    assert all(type(v) is int for v in ol.scaled(5, 7))
    ol.step = (1, 10)
    assert ol.scaled(5, 5) == (7, 1)                        # 0.5 us: the 1 us floor


def test_readings_between_two_snapshots():
    assert dy.since((0, 0, 0.0), (0, 1, 1.0)) == [0, 1]     # one step of 1 us
    assert dy.since((0, 0, 0.0), (0, 0, 5.0)) == [0, 0]     # time but no timed step
    assert dy.since((0, 0, 5.0), (0, 2, 3.0)) == [0, 0]     # counters that went back: none
    assert dy.since((10, 0, 0.0), (0, 0, 0.0)) == [0, 0]    # prefill never negative
    assert dy.readings((0, 0, 0.0), None, (7, 1, 3.0)) == [7, 3, 7, 3]     # window from zero


@pytest.fixture
def gloo_world_of_one(tmp_path):
    """A real gloo process group of this one process (the engine's TP group needs more
    processes: a world of one all-reduces each value with itself)."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()


def test_readings_are_agreed_over_the_group_when_it_has_more_than_one_rank(gloo_world_of_one, monkeypatch):
    calls = []
    real = tp_group.all_reduce_max

    def watched(values, group):
        calls.append((list(values), group))
        return real(values, group)

    monkeypatch.setattr(tp_group, "all_reduce_max", watched)
    group = gloo_world_of_one
    for layout, reduced in (((None, 1, 0), False), ((group, 1, 0), False), ((group, 2, 0), True),
                            ((group, 4, 3), True)):
        monkeypatch.setattr(tp_group, "engine_group", lambda layout=layout: layout)
        calls.clear()
        assert dy.agree((3, 1, 4, 1)) == [3, 1, 4, 1]
        assert calls == ([([3, 1, 4, 1], group)] if reduced else []), layout


def test_wanted_steps_takes_every_share_from_1_to_99():
    assert dy.wanted_steps(99, 100, 1) == 9_900
    assert dy.wanted_steps(1, 99, 1) == 1
    for pct in (0, 100):
        with pytest.raises(ValueError, match=rf"DSV41_DECODE_YIELD={pct}: out of range 1\.\.99"):
            dy.wanted_steps(pct, 100, 1)


def test_an_empty_extend_costs_nothing_whatever_its_prefix():
    """The squared-prefix term would price the prefix alone (1,000 tokens: 1,000,000 x 1 us):
    an extend of no tokens is not a pass of that request."""
    model = dy.CostModel(0, 0, 0, 0, 0, 0, 1_000_000)
    assert dy.chunk_cost_us(0, 1000, model) == 0
    assert dy.chunk_cost_us(1, 1000, model) == 1_000_000


# --- the achieved share and the per-prompt line ---------------------------------------------------

@pytest.mark.parametrize("start, end, steps, want", [
    # the window timed one step of 1 us: the window's mean stands for the 2 steps that ran
    ((0, 10, 100.0), (1_000, 11, 101.0), 2, (2 / 1_002, 2.0, 1_000)),
    # the window has time but no timed step: the mean since boot (105 us over 10 steps)
    ((0, 10, 100.0), (1_000, 10, 105.0), 1, (10.5 / 1_010.5, 10.5, 1_000)),
    # the window has timed steps but no time: the mean since boot (100 us over 12 steps)
    ((0, 10, 100.0), (1_000, 12, 100.0), 3, (25.0 / 1_025, 25.0, 1_000)),
    # since boot, one step of 1 us: it stands for the step that ran
    ((0, 1, 1.0), (10, 1, 1.0), 1, (1 / 11, 1.0, 10)),
    # 1 us of decode, no prefill: all of it was decode
    ((0, 0, 0.0), (0, 1, 1.0), 1, (1.0, 1.0, 0)),
    # nothing timed since boot either / no time at all
    ((0, 0, 0.0), (10, 0, 5.0), 1, (None, "the engine has timed no decode step yet (none followed another)")),
    ((0, 0, 0.0), (10, 2, 0.0), 1, (None, "the engine has timed no decode step yet (none followed another)")),
    ((10, 0, 0.0), (0, 1, 10.0), 1, (None, "no time recorded")),
])
def test_achieved_share_at_its_edges(start, end, steps, want):
    got = dy.achieved_share(start, end, steps)
    if want[0] is None:
        assert got == want
    else:
        assert got == pytest.approx(want)


def _flushed(caplog, st, scheduler, pct, counters):
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        dy._flush_log(st, scheduler, pct, counters)
    (line,) = [r.getMessage() for r in caplog.records if " left chunked prefill" in r.getMessage()]
    caplog.clear()
    return line[line.index("rid="):]


def test_the_per_prompt_line_states_the_measured_share_the_caps_and_the_online_scales(caplog):
    s = sim.build_scheduler(full_tokens=8192, swa_tokens=4096, chunk=2048)
    req = sim.make_req("p", 100, max_new_tokens=4)
    st = dy._State()
    st.log = [req, 2, 9, 1, 1, 1, 3]
    st.timing = (0, 10, 1_000.0)
    s.total_prefill_busy_us = 1_999_999_000            # 1,999.999 s of prefill in the window
    s.decode_moment_totals = [11.0, 0.0, 999_999_000.0 + 1_000.0, 0.0, 0.0, 0.0]   # 1 step timed
    st.online = dy.OnlineScales()
    st.online.chunk, st.online.step = (3, 2), (1, 4)
    counters = collections.Counter(achieved_share=0.5, share_measured=3)
    line = _flushed(caplog, st, s, 99, counters)
    assert line == ("rid=p left chunked prefill: 2 chunks yielded, 9 decode steps planned, 1 run, 1 "
                    "ended early; achieved share 0.33 (configured 0.99) by the engine's step timings: "
                    "decode 999.999 s over 1 steps, prefill 1999.999 s; 1 of 2 chunks capped at 128 "
                    "steps; online scales at its last arming: chunk x1.5, decode step x0.25; 3 plans "
                    "redone from the chunk's measured time (agreed over the TP group)")
    assert counters["achieved_share"] == pytest.approx(0.5 + 0.3333, abs=1e-9)   # rounded to 4 places
    assert counters["share_measured"] == 4
    assert (st.log, st.timing) == (None, None)
    # no timing at the arming, no cap, no online calibration: said so, nothing counted
    st.log, st.online = [req, 1, 1, 1, 0, 0, 0], None
    line = _flushed(caplog, st, s, 33, counters)
    assert line == ("rid=p left chunked prefill: 1 chunks yielded, 1 decode steps planned, 1 run, 0 "
                    "ended early; achieved share not measured (no engine step timings)")
    # a scheduler whose step counters cannot be read: the line says which error
    st.log, st.timing = [req, 1, 1, 1, 0, 0, 0], (0, 0, 0.0)
    del s.decode_moment_totals
    line = _flushed(caplog, st, s, 33, counters)
    assert line.endswith("achieved share not measured (engine step timings unreadable (AttributeError))")
    assert counters["share_measured"] == 4


def test_dp_attention_keeps_the_stock_interval_and_says_why():
    from test_decode_yield import _extend_batch, _hooks, _r, _sched

    from sglang.srt.runtime_context import get_parallel

    _, arm_hook, _, _ = _hooks({"DSV41_DECODE_YIELD": "50"})
    p = _r("p")
    s = _sched(p)
    s.require_mlp_sync = True
    with get_parallel().override(pp_size=1):
        arm_hook(lambda self, b: None, s, _extend_batch([p]))
    assert s.__dict__.get(dy._STATE) is None
    reason = ("DP attention (require_mlp_sync): the engine keeps the interval in step across DP ranks "
              "and their rows differ; stock interval kept")
    assert receipts.counters[dy.NAME][f"fallback:{reason}"] == 1


# --- install()'s closures: the online plan's accounting, the cap count, a failed re-plan ---------

LINE = re.compile(r"rid=p left chunked prefill: (\d+) chunks yielded, (\d+) decode steps planned, "
                  r"(\d+) run, (\d+) ended early")


def _prompt_line(caplog, **kw):
    """The scenario run until the prompt's line is written; (its line, trace, counters)."""
    from test_decode_yield import scenario

    receipts.forget(dy.NAME)
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        _, trace, _, _ = scenario(until=lambda lp: lp.s.chunked_req is None and "p" in lp.first_token_us
                                  and any(" left chunked prefill" in r.getMessage() for r in caplog.records),
                                  **kw)
    (line,) = [r.getMessage() for r in caplog.records if "rid=p left chunked prefill" in r.getMessage()]
    return line, trace, dict(receipts.counters[dy.NAME])


def test_the_online_line_adds_every_chunks_final_plan_and_each_re_plan(install_adapters, caplog):
    """Online, on a machine whose chunks take 3x the model's time: the prompt's line adds each
    chunk's final plan (planned = run = the decode steps between its chunks) and counts one re-plan
    per re-plan point each chunk's plan reached (deferral 2, 8, 32), as the counters do."""
    from test_decode_yield import _feed_machine, chunk_gaps

    state = install_adapters({"DSV41_DECODE_YIELD": "33", dy.ONLINE_KEY: "1"})[dy.NAME]
    assert state.status == "installed", state.detail
    line, trace, c = _prompt_line(caplog, on_step=_feed_machine(3.0, 1.0))
    gaps = [n for _, n, _ in chunk_gaps(trace)]
    chunks, planned, run, early = map(int, LINE.search(line).groups())
    assert (chunks, planned, run, early) == (len(gaps), sum(gaps), sum(gaps), 0), (line, gaps)
    replans = sum(1 for n in gaps for point in (2, 8, 32) if point <= n)
    assert f"; {replans} plans redone from the chunk's measured time" in line, (line, gaps)
    assert c["online_replans"] == replans and c["steps_planned"] == sum(gaps)
    assert len(gaps) >= 2 and any(n >= 8 for n in gaps), gaps


def test_the_line_counts_every_capped_chunk_of_a_fitted_model(install_adapters, caplog):
    """A fitted model whose chunks are worth far more than 128 decode steps: every non-final chunk
    is capped, and the line counts each of them."""
    from test_decode_yield import chunk_gaps

    model = "0,1000000000,0,1,0,0"                  # 1 s per prompt token, a decode step 1 us
    state = install_adapters({"DSV41_DECODE_YIELD": "33", dy.MODEL_KEY: model})[dy.NAME]
    assert state.status == "installed", state.detail
    line, trace, _ = _prompt_line(caplog)
    gaps = [n for _, n, _ in chunk_gaps(trace)]
    assert len(gaps) >= 2 and all(n == dy.MAX_STEPS for n in gaps), gaps
    assert line.endswith(f"; {len(gaps)} of {len(gaps)} chunks capped at 128 steps"), line


def test_a_failed_re_plan_is_contained_and_the_next_chunks_go_on(install_adapters, monkeypatch, caplog):
    """An exception inside the re-plan (planted in its agreement of the readings): one fallback
    line naming it per failed re-plan, the yield state dropped, the next chunks armed and agreed
    again, the scheduler's step goes on (the prompt finishes)."""
    from test_decode_yield import _feed_machine

    state = install_adapters({"DSV41_DECODE_YIELD": "33", dy.ONLINE_KEY: "1"})[dy.NAME]
    assert state.status == "installed", state.detail
    real = dy.agree

    def agree(values):
        if len(values) == 2:                         # the re-plan's [chunk, step] readings
            raise LookupError("planted")
        return real(values)

    monkeypatch.setattr(dy, "agree", agree)
    receipts.forget(dy.NAME)
    from test_decode_yield import scenario

    scenario(on_step=_feed_machine(3.0, 1.0))
    c = receipts.counters[dy.NAME]
    # the only fallbacks are the planted ones: the state the containment left (the calibration
    # restarted from the engine's counters as they are) carries the next chunks on
    planted = "fallback:internal error (LookupError); yield state dropped, stock interval kept"
    assert c[planted] >= 2 and [k for k in c if k.startswith("fallback:")] == [planted], dict(c)
    assert c["online_replans"] == 0 and c["online_scales_agreed"] >= 2


def test_the_installed_line_states_the_online_calibration(install_adapters):
    state = install_adapters({"DSV41_DECODE_YIELD": "33", dy.ONLINE_KEY: "1"})[dy.NAME]
    assert state.detail.endswith(
        "(DSV41_DECODE_YIELD_MODEL unset); online calibration: chunk and decode step times from the "
        "engine's own step timings (the model level-scaled at each non-final chunk, the plan redone "
        "from the chunk's measured time once it ran), agreed over the attention-TP group "
        "(DSV41_DECODE_YIELD_ONLINE=1)"), state.detail
    state = install_adapters({"DSV41_DECODE_YIELD": "33"})[dy.NAME]
    assert state.detail.endswith("(DSV41_DECODE_YIELD_MODEL unset)"), state.detail


def test_a_model_with_the_squared_prefix_term_prints_seven_integers():
    assert dy.CostModel(1, 2, 3, 4, 5, 6, 7).value() == "1,2,3,4,5,6,7"
    assert dy.CostModel(1, 2, 3, 4, 5, 6).value() == "1,2,3,4,5,6"
