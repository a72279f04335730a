"""Cone replay: a failure after a plan is taken never serves an unprepared replay (issue 30, item 3).

Once a request is admitted as a prefix hit at s, only cone's forward side (copy the resident
latents / index keys of [s, F), mask the replay rows' writes, floor their window at s) makes its
first pass compute what a prefix hit at F computes. If the copy fails (torch.OutOfMemoryError in
index_select, a ValueError from the page checks, any RuntimeError), the replay rows' pages hold
stale or half-copied latents: floor and mask alone would still answer wrong. Cone then fails the
request through the engine's own path for a forward that ran on KV that never landed
(`Req.discard_output_reason` + `skip_radix_cache_insert`): FINISH_ABORT (HTTP 503), no KV of it in
the tree. Mask and floor stay on for that pass, so its rows neither overwrite shared bytes nor read
evicted slots.

On the engine's real classes on CPU: DeepseekV4AttnBackend (the `dsv4` registry entry, built from
the engine kit's MockDSV4ModelRunner as tests/test_swa_cone_forward.py's harness builds it) over a
DeepSeekV4TokenToKVPool, ForwardBatch, Req, ScheduleBatch, the real UnifiedRadixCache +
PrefillAdder (adapter/tools/sims/swa_cone.py Driver), and the engine's own result processor
(SchedulerBatchResultProcessor.process_batch_result_prefill) and stash (checkpoint_kv_cache).
Stand-ins remain only where one CPU process cannot be the real thing, each saying why where it is:
the TP all-reduce of another rank's verdict, and the result processor's client stream and
metrics reporter (ZMQ sockets to the tokenizer manager / a Prometheus exporter).
"""
from __future__ import annotations

import dataclasses
import logging
import types
import weakref
from array import array

import pytest
import torch

from adapter import receipts
from test_swa_cone_copy import P, PAGES, _batch, _loc, pool  # noqa: F401 - pool: the copy tests' real DSV4 pool
N = 1024
COND = {"DSV41_SWA_CONE_REPLAY": "1", "DSV41_SWA_CONE_TOKENS": str(N)}
FAILURES = {
    # raised by the index_select of the second compress ratio: the first ratio's pages are
    # already copied (a half-done copy), as an allocation failure would leave them
    "OutOfMemoryError": torch.OutOfMemoryError,
    "RuntimeError": RuntimeError,
    # not planted: the copy's own page check refuses a destination that overlaps the source
    "ValueError": None,
}


# ---- forward side on a real DSV4 pool and ForwardBatch ----------------------------------------

def _req(rid, n=2000):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=array("q", range(1, n + 1)),
               sampling_params=SamplingParams(temperature=0, max_new_tokens=4))


@pytest.fixture(scope="module")
def backend(pool):
    """The engine's DeepseekV4AttnBackend on the copy tests' real DSV4 pool: the engine kit's
    MockDSV4ModelRunner (what DeepseekV4AttnBackend.__init__ reads, without loading a model), the
    backend built by the engine's `dsv4` registry entry; the kit's published server arguments
    are restored after the module."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.test.kits.attention_unittest.attention_methods import dsv4_attention as kit

    ratios = [0, 4, 128, 4]
    case = kit.DSV4AttentionCase(name="cone-failure", backend="dsv4", forward_mode=ForwardMode.EXTEND,
                                 num_heads=8, page_size=P, prefix_lens=(0,), extend_lens=(1,))
    config = kit.TinyDSV4ModelConfig(num_heads=8, context_len=PAGES * P, compression_ratios=ratios)
    runner = kit.MockDSV4ModelRunner(case=case, model_config=config, dtype=torch.bfloat16,
                                     device="cpu", max_context_len=PAGES * P, swa_size=P,
                                     runner_batch_size=4, compression_ratios=ratios)
    try:
        runner.token_to_kv_pool = pool
        built = ATTENTION_BACKENDS["dsv4"](runner)
        assert isinstance(built, DeepseekV4AttnBackend) and built.token_to_kv_pool is pool
        assert built.page_size == P
        yield built
    finally:
        runner._server_args_override.restore()


def _first_pass(cone, fb, backend):
    """Cone's _build_forward_metadata hook on `fb` with the engine's backend (the engine's own
    metadata build inside it is recorded, not run: it would plan the GPU kernels' metadata)."""
    ran = []
    cone.build_forward_metadata(lambda b, batch: ran.append((b, batch)), backend, fb)
    assert ran == [(backend, fb)]       # the engine's metadata build always runs


def plant(monkeypatch, name):
    """Make swa_cone_copy.copy_resident fail the way `name` does."""
    from adapter import swa_cone_copy as cc

    exc = FAILURES[name]
    if exc is None:
        return
    real = cc._pool_pages
    calls = {"n": 0}

    def failing(full_page_ids, page_size, ratio, pool_page):
        calls["n"] += 1
        if calls["n"] > 2:            # src and dst of the first ratio went through: half copied
            raise exc("planted in the copy step")
        return real(full_page_ids, page_size, ratio, pool_page)

    monkeypatch.setattr(cc, "_pool_pages", failing)


@pytest.mark.parametrize("failure", list(FAILURES))
def test_failed_copy_keeps_mask_and_floor_and_fails_the_request(backend, monkeypatch, caplog, failure):
    from adapter import swa_cone
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    receipts.forget("swa_cone")
    s, F, tail, other = 512, 1024, 100, 300
    r2t = backend.req_to_token
    r2t.zero_()
    fb = _batch(r2t, s=s, F=F, tail=tail, other=other)
    a, b = _req("A"), _req("B")
    cone = swa_cone.Cone(F - s, test=False)
    # ValueError: a source overlapping the destination pages (the copy's own page check).
    src = _loc([10, 11]) if failure == "ValueError" else _loc([3, 4])
    cone.plans["A"] = swa_cone.Plan(rid="A", F=F, s=s, L=F + tail, src_loc=src,
                                    req=weakref.ref(a))
    plant(monkeypatch, failure)
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        _first_pass(cone, fb, backend)
    assert "A" not in cone.plans
    # The window floor and the write mask of the plan are kept (never an unfloored replay) ...
    n_a = F + tail - s
    assert torch.equal(fb.encoder_swa_row_floor, torch.tensor([s] * n_a + [0] * other))
    keep = torch.cat([torch.arange(F - s, n_a), torch.arange(n_a, n_a + other)])
    assert torch.equal(fb.encoder_swa_compress_rows, keep)
    seen = {}
    assert backend.token_to_kv_pool.request_window is None     # the paged SWA path
    cone.init_prefill_metadata(lambda b, **kw: seen.update(kw), backend,
                               forward_batch=fb, out_cache_loc=fb.out_cache_loc,
                               swa_replay_start=None)
    assert torch.equal(seen["swa_replay_start"], fb.encoder_swa_row_floor)
    # ... and the request is failed through the engine's discard path, not served.
    assert isinstance(a.discard_output_reason, FINISH_ABORT)
    assert a.discard_output_reason.status_code == 503
    assert "could not be prepared" in a.discard_output_reason.message
    assert a.skip_radix_cache_insert is True
    assert b.discard_output_reason is None and b.skip_radix_cache_insert is False
    counts = receipts.counters["swa_cone"]
    assert counts["replays_aborted"] == 1 and counts["copies"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert [m for m in lines if " abort request=A rows=[512,1024): replay copy failed "
            f"({failure})" in m]
    assert [m for m in lines if "swa_cone fallback: replay copy failed "
            f"({failure}): request failed (HTTP 503)" in m]


def test_a_failure_on_another_tp_rank_fails_the_request_here_too(backend):
    """The verdict is reduced over the cache's TP groups: a copy that worked here but not on
    another rank fails the request on every rank alike."""
    from adapter import swa_cone

    receipts.forget("swa_cone")
    s, F = 512, 1024
    r2t = backend.req_to_token
    r2t.zero_()
    fb = _batch(r2t, s=s, F=F, tail=100, other=300)
    a = _req("A")

    class _Tree:
        """Stand-in for the cache's NCCL all-reduce over its attention TP groups: one CPU
        process is one rank, so another rank's 0 (its copy failed) can only be planted here."""

        def _all_reduce_attn_groups(self, tensor, op):
            assert op == torch.distributed.ReduceOp.MIN
            tensor.zero_()                  # what MIN gives when another rank reports 0

    cone = swa_cone.Cone(F - s, test=False)
    cone.plans["A"] = swa_cone.Plan(rid="A", F=F, s=s, L=F + 100, src_loc=_loc([3, 4]),
                                    req=weakref.ref(a), tree=_Tree())
    _first_pass(cone, fb, backend)
    assert receipts.counters["swa_cone"]["copies"] == 1          # copied here ...
    assert a.discard_output_reason is not None and a.skip_radix_cache_insert   # ... failed anyway
    assert "another TP rank" in a.discard_output_reason.message
    assert fb.encoder_swa_row_floor is not None


# ---- end to end: the real cache, adder and the engine's result processor ---------------------

def _world(install_adapters):
    from adapter.tools.sims.swa_cone import Driver, build

    status = install_adapters(COND)
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail
    cpu = build(60_000, 4096, "python")
    drv = Driver(cpu, chunk=2048)
    doc = list(range(1, 6001))
    drv.prefill(doc, output_tokens=[7] * 40)
    for i in range(12):                 # the document's SWA window is evicted
        start = 1_000_000 + 1024 * i
        drv.prefill(list(range(start, start + 1024)), output_tokens=[5] * 16)
    return cpu, drv, doc + list(range(900_000, 900_700))


def _full_resident_end(drv, tokens):
    """Page-aligned resident full KV of `tokens` (the engine's read-only FULL-device match)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    matched, _, _ = drv.cache.tree_core.match_full_device_prefix(RadixKey(array("q", tokens[:-1])))
    return matched // P * P


def _first_pass_batch(drv, req):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    r2t = drv.cpu.req_to_token_pool.req_to_token
    slot, s, end = req.kv.req_pool_idx, req.prefix_len, req.extend_end
    out = r2t[slot, s:end].to(torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1,
                      input_ids=torch.zeros(end - s, dtype=torch.int64),
                      req_pool_indices=torch.tensor([slot]), seq_lens=torch.tensor([end]),
                      out_cache_loc=out, seq_lens_sum=end)
    fb.rids = [req.rid]
    fb.extend_prefix_lens_cpu = [s]
    fb.extend_seq_lens_cpu = [end - s]
    fb.req_pool_indices_cpu = torch.tensor([slot])
    return fb


def _process_result(drv, req, *, token=42):
    """The engine's own result processing of a prefill batch holding `req` (the scheduler's
    SchedulerBatchResultProcessor and a real ScheduleBatch, built without a model)."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch, get_batch_return_hidden_states_mode
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor)
    from sglang.srt.managers.utils import GenerationBatchResult
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    streamed = []
    fields = {f.name: None for f in dataclasses.fields(SchedulerBatchResultProcessor)}
    fields.update(
        is_generation=True, enable_overlap=False, token_to_kv_pool_allocator=drv.cpu.allocator,
        tree_cache=drv.cache, req_to_token_pool=drv.cpu.req_to_token_pool,
        # Stand-ins: the scheduler's stream to the tokenizer manager is a ZMQ socket and its
        # metrics reporter a Prometheus exporter, neither of which exists without a server;
        # they record what the processor sends.
        output_streamer=types.SimpleNamespace(
            stream_output=lambda reqs, *a, **k: streamed.extend(reqs)),
        metrics_reporter=types.SimpleNamespace(report_prefill_stats=lambda **k: None))
    proc = SchedulerBatchResultProcessor(**fields)
    # The fields ScheduleBatch.init_new sets for these requests (its ModelConfig is read only
    # for a chunked request's next prompt token, which a prefill result does not use).
    batch = ScheduleBatch(reqs=[req], req_to_token_pool=drv.cpu.req_to_token_pool,
                          token_to_kv_pool_allocator=drv.cpu.allocator, tree_cache=drv.cache,
                          enable_overlap=False, return_logprob=False, forward_iter=0,
                          return_hidden_states_mode=get_batch_return_hidden_states_mode([req]),
                          spec_algorithm=SpeculativeAlgorithm.NONE, device="cpu")
    result = GenerationBatchResult(logits_output=None, next_token_ids=torch.tensor([token]),
                                   can_run_cuda_graph=False)
    proc.process_batch_result_prefill(batch, result)
    return streamed


def _plan_and_admit(drv, prompt):
    from adapter import swa_cone

    req = drv._req(prompt, max_new_tokens=4)
    req.init_next_round_input(drv.cache)
    stock = req.prefix_len
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert any(r is req for r in adder.can_run_list)
    plan = swa_cone.state().plans[req.rid]
    assert req.prefix_len == plan.s and plan.req() is req
    return req, plan, stock


@pytest.mark.parametrize("failure", ["OutOfMemoryError", "ValueError", "RuntimeError"])
def test_failed_replay_finishes_with_an_error_and_leaves_the_tree_as_stock(
        install_adapters, backend, monkeypatch, failure):
    """The request admitted at s whose copy failed: the engine's result processor finishes it
    with FINISH_ABORT (503) and no token; none of its KV reaches the tree, so the same prompt
    arriving next is matched exactly as it was before (the stock match, the same candidate)."""
    from adapter import swa_cone
    from adapter import swa_cone_copy as cc
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.mem_cache.common import checkpoint_kv_cache

    cpu, drv, prompt = _world(install_adapters)
    receipts.forget("swa_cone")
    probe = drv._req(prompt)
    probe.init_next_round_input(drv.cache)
    before = (probe.prefix_len, getattr(probe, swa_cone.CAND_ATTR).F,
              getattr(probe, swa_cone.CAND_ATTR).s)
    assert _full_resident_end(drv, prompt) == before[1]
    req, plan, stock = _plan_and_admit(drv, prompt)
    assert (stock, plan.F, plan.s) == before
    drv._extend(req, req.extend_end)                        # alloc_for_extend
    fb = _first_pass_batch(drv, req)
    if FAILURES[failure] is None:
        monkeypatch.setattr(cc, "copy_resident", lambda *a, **k: cc.full_pages(
            torch.arange(7), P))                            # the page check's own ValueError
    else:
        def boom(*a, **k):
            raise FAILURES[failure]("planted in the copy step")
        monkeypatch.setattr(cc, "copy_resident", boom)
    # The backend reads this world's req_to_token (the engine wires ModelRunner's
    # req_to_token_pool to the scheduler's); the copy fails before it touches the pool.
    monkeypatch.setattr(backend, "req_to_token", cpu.req_to_token_pool.req_to_token)
    _first_pass(swa_cone.state(), fb, backend)
    assert fb.encoder_swa_row_floor is not None                 # the pass runs floored
    chunks = 0
    while req.extend_end < len(req.full_untruncated_fill_ids):  # middle chunks: stashed
        req.inflight_middle_chunks = 1
        _process_result(drv, req)
        checkpoint_kv_cache(req, drv.cache)                     # Scheduler.stash_chunked_request
        adder = drv.adder()
        adder.add_chunked_req(req)
        drv._extend(req, req.extend_end)
        chunks += 1
    assert chunks == 1                                          # a middle chunk was stashed
    streamed = _process_result(drv, req)
    assert req.finished() and isinstance(req.finished_reason, FINISH_ABORT)
    assert req.finished_reason.status_code == 503 and len(req.output_ids) == 0
    assert streamed and streamed[-1] is req                     # the error goes to the client
    assert not req.kv.holds_kv
    drv.cache.sanity_check()
    # None of its KV was inserted: the prompt's resident full KV still ends at F, not past it.
    assert _full_resident_end(drv, prompt) == plan.F
    again = drv._req(prompt)
    again.init_next_round_input(drv.cache)
    cand = getattr(again, swa_cone.CAND_ATTR)
    assert (again.prefix_len, cand.F, cand.s) == before
    assert receipts.counters["swa_cone"]["replays_aborted"] == 1


def test_a_failing_plan_step_fails_the_admitted_request(install_adapters, monkeypatch):
    """An exception in the plan step itself (after admission committed the hit at s): the
    request is failed, not left to run unfloored."""
    from adapter import swa_cone

    cpu, drv, prompt = _world(install_adapters)
    receipts.forget("swa_cone")

    def broken(self, plan):
        raise MemoryError("planted")

    monkeypatch.setattr(swa_cone.Cone, "_store", broken)
    req = drv._req(prompt)
    req.init_next_round_input(drv.cache)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert any(r is req for r in adder.can_run_list) and req.rid not in swa_cone.state().plans
    assert req.discard_output_reason is not None and req.skip_radix_cache_insert
    assert "internal error in the plan step (MemoryError)" in req.discard_output_reason.message


# ---- the plan store: bounded by bytes, dropped plans counted ---------------------------------

def test_plan_store_is_bounded_by_bytes_and_counts_what_it_drops(monkeypatch):
    from adapter import swa_cone

    receipts.forget("swa_cone")
    monkeypatch.setattr(swa_cone, "MAX_PLAN_BYTES", 3 * (N * 8 + 256))
    cone = swa_cone.Cone(N, test=False)
    reqs = [_req(f"q{i}") for i in range(5)]
    for r in reqs:
        cone._store(swa_cone.Plan(rid=r.rid, F=2 * N, s=N, L=2 * N + 1,
                                  src_loc=torch.arange(N), req=weakref.ref(r)))
    assert list(cone.plans) == ["q2", "q3", "q4"] and cone.plan_bytes() <= swa_cone.MAX_PLAN_BYTES
    counts = receipts.counters["swa_cone"]
    assert counts["plans_dropped"] == 2 and counts["replays_aborted"] == 2
    # A dropped plan whose request still waits for its pass: that request is failed.
    assert all(r.discard_output_reason is not None for r in reqs[:2])
    assert all(r.discard_output_reason is None for r in reqs[2:])
    # Plans of requests that finished (aborted before their pass) or are gone are pruned, not
    # failed, at the next plan.
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    reqs[2].finished_reason = FINISH_ABORT("client abort")
    del reqs[3]
    nxt = _req("q5")
    cone._store(swa_cone.Plan(rid="q5", F=2 * N, s=N, L=2 * N + 1, src_loc=torch.arange(N),
                              req=weakref.ref(nxt)))
    assert list(cone.plans) == ["q4", "q5"]
    assert counts["plans_dropped"] == 4 and counts["replays_aborted"] == 2


def test_dropped_and_aborted_counters_have_series():
    from adapter import metrics, swa_cone

    assert {"plans_dropped", "replays_aborted"} <= set(swa_cone.COUNTERS)
    assert metrics.series_of("swa_cone", "plans_dropped") == ("dsv41_swa_cone_plans_dropped", ())
    assert metrics.series_of("swa_cone", "replays_aborted") == ("dsv41_swa_cone_replays_aborted",
                                                                ())


# ---- the window floor handed to init_forward_metadata_prefill (found by bench/mutation.py) ----

def test_prefill_metadata_gets_the_floor_padded_to_the_batchs_rows(backend, monkeypatch):
    """The floor set by the first pass's metadata hook reaches the engine's
    init_forward_metadata_prefill as `swa_replay_start`: padded with 0 (no floor) to the rows of
    `out_cache_loc` on the paged SWA path, as it is where it already covers them, not at all on
    the request-window path (which reads encoder_swa_row_floor), never over a value the engine
    passed itself; a floor that cannot be padded is passed unpadded (it covers every real row)."""
    from adapter import swa_cone

    receipts.forget("swa_cone")
    cone = swa_cone.Cone(N, test=False)
    calls = []

    def engine(b, *args, **kwargs):
        calls.append((b, args, kwargs))
        return "metadata"

    def run(fb, **kwargs):
        calls.clear()
        assert cone.init_prefill_metadata(engine, backend, "pos", forward_batch=fb, **kwargs) == "metadata"
        ((b, args, kw),) = calls
        assert b is backend and args == ("pos",)
        return kw

    floor = torch.tensor([512, 512, 0])
    fb = types.SimpleNamespace(**{swa_cone.FLOOR_ATTR: floor})
    kw = run(fb, out_cache_loc=torch.zeros(5), swa_replay_start=None)
    assert torch.equal(kw["swa_replay_start"], torch.tensor([512, 512, 0, 0, 0]))
    kw = run(fb, out_cache_loc=torch.zeros(3), swa_replay_start=None)
    assert kw["swa_replay_start"] is floor
    mine = torch.tensor([7, 7, 7])
    assert run(fb, out_cache_loc=torch.zeros(5), swa_replay_start=mine)["swa_replay_start"] is mine
    assert run(types.SimpleNamespace(), out_cache_loc=torch.zeros(5), swa_replay_start=None) == \
        {"forward_batch": calls[0][2]["forward_batch"], "out_cache_loc": calls[0][2]["out_cache_loc"],
         "swa_replay_start": None}
    kw = run(fb, swa_replay_start=None)                      # no out_cache_loc: cannot pad
    assert kw["swa_replay_start"] is floor
    assert receipts.counters["swa_cone"]["fallback:internal error in the window floor step "
                                         "(KeyError); that step left to the engine"] == 1
    monkeypatch.setattr(backend.token_to_kv_pool, "request_window", object(), raising=False)
    assert run(fb, out_cache_loc=torch.zeros(5), swa_replay_start=None)["swa_replay_start"] is None
