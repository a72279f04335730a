"""Hooks that hold a request between two of their calls survive its abort or retraction, and no
exception of an adapter's own reaches the scheduler (issue 23, part 3).

On the engine's real classes on CPU, adapters installed by the production installer:
- decode yield: its armed deferral holds the chunked prompt and counts the decode rows between
  `get_next_batch_to_run` and the next `_should_defer_prefill`. A decode stream retracted by the
  engine's own retraction (`update_running_batch` with SGLANG_TEST_RETRACT's switch) or aborted by
  `abort_request` mid-deferral. (The chunked prompt itself aborted mid-deferral:
  tests/test_decode_yield.py test_abort_mid_prefill_ends_the_yield.) The real Scheduler step of
  adapter/tools/sims/decode_yield.py (its docstring lists the stand-ins).
- swa_thin: a chunked request whose passed checkpoints thin moved to the evict-first end, then
  aborted the way `process_pending_chunked_abort` tears it down, or retracted by the engine's
  `release_req`; the moved nodes are then evicted by other traffic, the same prompt comes back.
- swa_cone: a request with a replay candidate (match) aborted or retracted before admission,
  with the tree changed in between; a request with a committed plan aborted before its first
  pass, its rid re-admitted without one. The real UnifiedRadixCache and PrefillAdder
  (adapter/tools/sims/swa_cone.py Driver).
Containment: an adapter function made to raise gives one fallback line and the engine's step
goes on; an exception raised by the engine inside a hooked call still propagates unchanged.
"""
from __future__ import annotations

import logging
import types

import pytest

from adapter import receipts

CHUNK = 8192


# --- decode yield ---------------------------------------------------------------------------------

@pytest.fixture
def yield_loop(install_adapters):
    """(loop, streams, prompt) with decode yield 50 installed: two streams decoding, then a cold
    prompt of five full chunks and a short one."""
    from adapter.tools.sims import decode_yield as sim

    def build(pct=50, stream_new=400):
        if pct is not None:
            state = install_adapters({"DSV41_DECODE_YIELD": str(pct)})["decode_yield"]
            assert state.status == "installed", state.detail
        else:
            install_adapters({})
        receipts.forget("decode_yield")
        s = sim.build_scheduler(chunk=CHUNK, req_slots=8, full_tokens=98_304, swa_tokens=49_152)
        # What update_running_batch's retraction reads besides the step's own state.
        s.metrics_reporter = types.SimpleNamespace(num_retracted_reqs=0, enable_metrics=False)
        s.max_queued_requests = None
        loop = sim.Loop(s)
        streams = [sim.make_req(f"s{i}", 1024, max_new_tokens=stream_new, salt=i + 1) for i in range(2)]
        for r in streams:
            loop.submit(r)
        loop.run_until(lambda: all(len(r.output_ids) >= 2 for r in streams))
        p = sim.make_req("p", 5 * CHUNK + 1000, max_new_tokens=1, salt=50)
        loop.submit(p)
        return loop, streams, p

    return build


def _chunks(loop, rid="p"):
    return sum(st.kind == "extend" and rid in st.rids for st in loop.trace)


def _run_to_the_end(loop, reqs, limit=5000):
    for _ in range(limit):
        if all(r.finished() for r in reqs):
            return
        loop.step()
    raise AssertionError([(r.rid, r.finished(), len(r.output_ids)) for r in reqs])


def _armed_after_chunk(loop, n):
    from adapter import decode_yield as dy

    for _ in range(2000):
        if _chunks(loop) >= n and dy.decisions(loop.s)["armed"]:
            return
        loop.step()
    raise AssertionError("the yield never armed")


def test_yield_survives_a_stream_retracted_mid_deferral(yield_loop, monkeypatch):
    import sglang.srt.managers.scheduler as engine

    from adapter import decode_yield as dy

    loop, streams, p = yield_loop()
    _armed_after_chunk(loop, 2)
    left = dy.decisions(loop.s)["left"]
    monkeypatch.setattr(engine, "TEST_RETRACT", True)       # the engine's own retraction switch
    monkeypatch.setattr(engine, "TEST_RETRACT_INTERVAL", 1)
    step = loop.step()                                      # update_running_batch retracts one
    monkeypatch.setattr(engine, "TEST_RETRACT", False)
    retracted = [r for r in streams if r.is_retracted or r in loop.s.waiting_queue]
    assert len(retracted) == 1 and step.kind == "decode" and step.deferred is True
    # The deferral goes on with the one row left; the retracted stream is re-admitted later.
    assert dy.decisions(loop.s) == {"armed": True, "left": left - 1, "rid": "p"}
    _run_to_the_end(loop, [p, *streams])
    assert dy.decisions(loop.s)["armed"] is False
    counts = dict(receipts.counters["decode_yield"])
    assert counts["steps_deferred"] == counts["steps_planned"] and "ended_early_streams_finished" not in counts
    assert len(streams[0].output_ids) == len(streams[1].output_ids) == 400
    loop.s.tree_cache.sanity_check()


def test_yield_survives_its_streams_aborted_mid_deferral(yield_loop):
    from adapter import decode_yield as dy

    loop, streams, p = yield_loop()
    _armed_after_chunk(loop, 2)
    for r in streams:
        loop.abort(r.rid)                                   # the engine's abort_request
    _run_to_the_end(loop, [p])
    assert all(r.finished() for r in streams) and not any(r.kv.holds_kv for r in streams)
    assert dy.decisions(loop.s)["armed"] is False
    assert receipts.counters["decode_yield"]["ended_early_streams_finished"] == 1
    loop.s.tree_cache.sanity_check()


def test_a_failing_yield_is_one_fallback_line_and_the_step_goes_on(yield_loop, monkeypatch, caplog):
    from adapter import decode_yield as dy

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted")

    monkeypatch.setattr(dy, "yield_steps", broken)          # the yield's own arithmetic
    loop, streams, p = yield_loop()
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        _run_to_the_end(loop, [p])
    lines = [r.getMessage() for r in caplog.records if "decode_yield fallback" in r.getMessage()]
    assert lines == ["[dsv41] decode_yield fallback: internal error (ZeroDivisionError); yield "
                     "state dropped, stock interval kept (logged once)"]
    assert receipts.counters["decode_yield"]["fallback:" + lines[0].split("fallback: ")[1]
                                             .removesuffix(" (logged once)")] == 5
    # never armed: every chunk followed by the stock interval's one decode step
    gaps = []
    for st in loop.trace:
        if st.kind == "extend" and "p" in st.rids:
            gaps.append(0)
        elif gaps and st.kind == "decode":
            gaps[-1] += 1
    assert gaps[:-1] == [1] * 5 and dy.decisions(loop.s)["armed"] is False


def test_an_engine_exception_in_a_hooked_step_propagates_unchanged(yield_loop):
    loop, streams, p = yield_loop()

    def engine_fails():
        raise RuntimeError("planted engine error")

    loop.s.process_pending_chunked_abort = engine_fails    # called by the engine's own step
    with pytest.raises(RuntimeError, match="^planted engine error$"):
        loop.step()


# --- swa_thin and swa_cone: the real cache and PrefillAdder ----------------------------------------

def _cache(install_adapters, keys, *, full=60_000, swa=4096, backend="python"):
    from adapter.tools.sims.swa_cone import Driver, build

    status = install_adapters(keys)
    for name, state in status.items():
        if state.status not in ("off",):
            assert state.status == "installed", (name, state.detail)
    cpu = build(full, swa, backend)
    return cpu, Driver(cpu, chunk=1024)


def _admit(drv, req):
    req.init_next_round_input(drv.cache)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert any(r is req for r in adder.can_run_list), req.rid


def _chunks_through(drv, req, passes):
    """`passes` chunks of an admitted request, each checkpointed as Scheduler.stash_chunked_request."""
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    for _ in range(passes):
        drv._extend(req, req.extend_end)
        checkpoint_kv_cache(req, drv.cache)
        adder = drv.adder()
        adder.add_chunked_req(req)
        assert any(r is req for r in adder.can_run_list)


def _abort_chunked(drv, req):
    """What process_pending_chunked_abort does to the cache for an aborted chunked request."""
    from sglang.srt.mem_cache.common import release_kv_cache

    release_kv_cache(req, drv.cache, checkpoint=False)


def _retract(drv, req):
    """The engine's retraction of one decoding request (ScheduleBatch.retract_decode's release_req)."""
    from sglang.srt.managers.schedule_batch import release_req

    assert release_req(req=req, remaing_req_count=0, req_to_token_pool=drv.cpu.req_to_token_pool,
                       token_to_kv_pool_allocator=drv.cpu.allocator, tree_cache=drv.cache,
                       hisparse_coordinator=None)


def _traffic(drv, n=12, base=1_000_000):
    for i in range(n):                  # 12 x 1040 tokens through a 4096-slot SWA pool
        start = base + 1024 * i
        drv.prefill(list(range(start, start + 1024)), output_tokens=[5] * 16)


def _thin():
    return dict(receipts.counters["swa_thin"])


def test_thin_survives_the_abort_of_a_request_whose_checkpoints_it_moved(install_adapters):
    cpu, drv = _cache(install_adapters, {"DSV41_SWA_THIN": "1"})
    receipts.forget("swa_thin")
    doc = list(range(1, 6001))
    req = drv._req(doc)
    _admit(drv, req)
    _chunks_through(drv, req, 3)
    assert _thin().get("checkpoints_passed", 0) >= 2 and _thin().get("nodes_moved", 0) >= 1
    _abort_chunked(drv, req)
    drv.cache.sanity_check()
    _traffic(drv)                       # the moved nodes go first
    drv.cache.sanity_check()
    again, first_prefix, _ = drv.prefill(doc + [3] * 200, output_tokens=[7] * 8)
    assert again.finished() and first_prefix % 256 == 0
    drv.cache.sanity_check()
    assert not [k for k in _thin() if k.startswith("fallback:")]


def test_thin_survives_the_retraction_of_a_request_whose_checkpoints_it_moved(install_adapters):
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache

    cpu, drv = _cache(install_adapters, {"DSV41_SWA_THIN": "1"})
    receipts.forget("swa_thin")
    doc = list(range(1, 4001))
    req = drv._req(doc, max_new_tokens=64)
    _admit(drv, req)
    _chunks_through(drv, req, 3)
    drv._extend(req, req.extend_end)            # the last chunk
    req.output_ids.extend([9] * 10)             # decoding
    moved = _thin().get("nodes_moved", 0)
    assert moved >= 1
    _retract(drv, req)                          # back to the waiting queue, KV released
    assert req.is_retracted and not req.kv.holds_kv
    drv.cache.sanity_check()
    _traffic(drv, n=6)
    _admit(drv, req)                            # re-admitted: matched again from the tree
    while req.extend_end < len(req.full_untruncated_fill_ids):
        _chunks_through(drv, req, 1)
    drv._extend(req, req.extend_end)
    req.finished_len = req.kv.kv_committed_len
    req.finished_reason = FINISH_LENGTH(length=1)
    release_kv_cache(req, drv.cache, checkpoint=True)
    drv.cache.sanity_check()
    assert _thin()["checkpoints_passed"] >= 4
    assert not [k for k in _thin() if k.startswith("fallback:")]


def test_a_failing_thin_move_is_one_fallback_line_and_the_insert_stands(install_adapters, monkeypatch):
    import adapter.swa_thin as thin

    cpu, drv = _cache(install_adapters, {"DSV41_SWA_THIN": "1"})
    receipts.forget("swa_thin")

    def broken(*args, **kwargs):
        raise IndexError("planted")

    monkeypatch.setattr(thin, "move_passed_checkpoint", broken)
    req, _, _ = drv.prefill(list(range(1, 6001)), output_tokens=[7] * 8)
    assert req.finished()
    drv.cache.sanity_check()
    counts = _thin()
    reason = "fallback:move failed (IndexError); this checkpoint keeps the engine's SWA LRU order"
    assert counts[reason] == counts["hooked_inserts"] - 1 >= 5   # every move but the first insert's
    again, prefix, _ = drv.prefill(list(range(1, 6001)) + [3] * 100)
    assert prefix >= 5888                      # the inserts stood: the prompt is cached


COND = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": "1024"}


def _cone_setup(install_adapters, backend="python"):
    cpu, drv = _cache(install_adapters, COND, backend=backend)
    drv.chunk = 2048
    doc = list(range(1, 6001))
    drv.prefill(doc, output_tokens=[7] * 40)
    _traffic(drv)                               # the document's SWA window is evicted
    return cpu, drv, doc + list(range(900_000, 900_700))


def test_cone_candidate_survives_abort_and_a_changed_tree_before_admission(install_adapters, caplog):
    from adapter import swa_cone

    cpu, drv, prompt = _cone_setup(install_adapters)
    receipts.forget("swa_cone")
    gone = drv._req(prompt)
    gone.init_next_round_input(drv.cache)       # matched in the waiting queue: a candidate
    assert getattr(gone, swa_cone.CAND_ATTR) is not None
    # aborted from the waiting queue (never admitted: it holds no lock); the tree moves on
    _traffic(drv, n=4, base=2_000_000)
    req = drv._req(prompt)
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        _admit(drv, req)
    plans = [r.getMessage() for r in caplog.records if " plan " in r.getMessage()]
    assert len(plans) == 1 and f"request={req.rid} " in plans[0]
    assert set(swa_cone.state().plans) == {req.rid}
    drv.cache.sanity_check()
    # A retracted request comes back to the waiting queue and is matched again: a stale
    # candidate of an older tree is dropped at admission if the tree changed meanwhile.
    stale = drv._req(prompt)
    stale.init_next_round_input(drv.cache)
    cand = getattr(stale, swa_cone.CAND_ATTR)
    cand.node_F = cand.node_s                   # as if the tree under it changed
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        adder = drv.adder()
        adder.add_one_req(stale, has_chunked_req=False, truncation_align_size=None)
    assert any("tree changed between match and admission" in r.getMessage() for r in caplog.records)
    assert stale.prefix_len == cand.stock_len
    drv.cache.sanity_check()


def test_cone_plan_of_a_request_aborted_before_its_first_pass_is_never_applied(install_adapters):
    from adapter import swa_cone

    cpu, drv, prompt = _cone_setup(install_adapters)
    req = drv._req(prompt)
    _admit(drv, req)
    assert req.rid in swa_cone.state().plans
    drv._extend(req, req.extend_end)            # its first pass allocated (alloc_for_extend)
    _abort_chunked(drv, req)                    # no forward here consumed the plan
    drv.cache.sanity_check()                    # the plan's lock on the node at F went with it
    _traffic(drv, n=4, base=3_000_000)
    # the same rid (a client retry) comes back with a stock match: the stale plan is dropped
    retry = drv._req([11] * 300)
    retry.rid = req.rid
    _admit(drv, retry)
    assert req.rid not in swa_cone.state().plans
    drv.cache.sanity_check()


def test_a_failing_cone_candidate_is_one_fallback_line_and_the_stock_match_stands(install_adapters,
                                                                                 monkeypatch):
    from adapter import swa_cone

    cpu, drv, prompt = _cone_setup(install_adapters)
    receipts.forget("swa_cone")

    def broken(self, *args, **kwargs):
        raise KeyError("planted")

    monkeypatch.setattr(swa_cone.Cone, "candidate", broken)
    req = drv._req(prompt)
    _admit(drv, req)                            # the stock match: no plan
    assert req.rid not in swa_cone.state().plans and req.prefix_len < 512
    reason = "fallback:internal error in the candidate step (KeyError); that step left to the engine"
    assert receipts.counters["swa_cone"][reason] == 1
    drv.cache.sanity_check()
