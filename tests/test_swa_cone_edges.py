"""Cone replay, match side, the edges a plain scenario does not reach (mutation survivors of
adapter/swa_cone.py, docs/testing.md): a first pass ending exactly at F, the budget the
re-admission after a refused replay hands the engine, a request in an extra-key namespace (LoRA /
cache salt), and a cache that is disabled or has no SWA component. On the same real
UnifiedRadixCache (FULL + SWA) and PrefillAdder as tests/test_swa_cone.py."""
import logging

import pytest

from adapter import receipts
from test_swa_cone import N, _arrive, _cone_env, _full_resident_end, _setup


def _installed(install_adapters):
    receipts.forget("swa_cone")
    status = install_adapters(_cone_env())
    assert status["swa_cone"].status == "installed", status["swa_cone"].detail


def test_a_first_pass_ending_exactly_at_f_plans_the_replay(install_adapters):
    """The chunk budget is N: the first pass from s = F - N ends at F exactly, which covers the
    replay (the rows [s, F) are all in it)."""
    from adapter import swa_cone

    _installed(install_adapters)
    cpu, drv, prompt = _setup("python")
    drv.chunk = N
    req = _arrive(drv, prompt)
    F = _full_resident_end(cpu, prompt)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list
    assert (req.prefix_len, req.extend_end) == (F - N, F)
    plan = swa_cone.state().plans[req.rid]
    assert (plan.s, plan.F) == (F - N, F)
    assert receipts.counters["swa_cone"]["plans"] == 1


def _setup_shared(shared):
    """_setup's scenario with the evicting prompts sharing the document's first `shared` tokens:
    their prefills keep that prefix's window, so the stock match is `shared` tokens, not 0."""
    from adapter.tools.sims.swa_cone import Driver, build
    from test_swa_cone import CHUNK, DOC, TAIL

    cpu = build(60_000, 4096, "python")
    drv = Driver(cpu, chunk=CHUNK)
    doc = list(range(1, DOC + 1))
    drv.prefill(doc, output_tokens=[7] * 40)
    for i in range(12):
        start = 1_000_000 + 1024 * i
        drv.prefill(doc[:shared] + list(range(start, start + 1024)), output_tokens=[5] * 16)
    return cpu, drv, doc + list(range(900_000, 900_000 + TAIL))


@pytest.mark.parametrize("shared", [0, 512])
def test_the_re_admission_after_a_refused_replay_asks_the_stock_budget(install_adapters, monkeypatch,
                                                                       shared):
    """A first pass that cannot cover the replay (chunk 512 < N): the engine's admission is asked
    again at the stock match (0 or 512 tokens), with the request's total tokens grown by the rows
    between the stock hit and s (the engine's own budget check sees each call's figures, recorded
    as it runs)."""
    _installed(install_adapters)
    cpu, drv, prompt = _setup("python") if shared == 0 else _setup_shared(shared)
    drv.chunk = 512
    req = _arrive(drv, prompt)
    stock = req.prefix_len
    assert stock == shared
    F = _full_resident_end(cpu, prompt)
    s = F - N
    adder = drv.adder()
    seen = []
    real = adder.memory_budget.check_prefill

    def watched(**kwargs):
        seen.append(kwargs)
        return real(**kwargs)

    monkeypatch.setattr(adder.memory_budget, "check_prefill", watched)
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    assert req in adder.can_run_list and req.prefix_len == stock
    at_s, at_stock = seen                          # cone's admission at s, then the stock one
    assert at_s["extend_input_len"] == len(prompt) - s
    assert at_stock["extend_input_len"] == len(prompt) - stock
    assert at_stock["total_tokens"] - at_s["total_tokens"] == s - stock > 0


@pytest.mark.parametrize("extra", [{"extra_key": "tenant-a"}, {"lora_id": "lora-7"}, {"cache_salt": "salt-1"}])
def test_a_request_in_an_extra_key_namespace_plans_within_it(install_adapters, monkeypatch, extra):
    """The document and its resume both carry an extra key (a namespace key, or a LoRA adapter's
    id, which the engine appends to it) or a cache salt: the re-match at s walks that namespace's
    branch of the tree (the key cut at s keeps the extra key and the salt), and the replay is
    planned there, as it is without one; the same tokens without them find none of it."""
    from adapter import swa_cone
    from adapter.tools.sims.swa_cone import Driver
    from sglang.srt.managers.schedule_batch import Req

    def in_namespace(self, tokens, max_new_tokens=1):
        req = real(self, tokens, max_new_tokens)
        return Req(rid=req.rid, origin_input_text="", origin_input_ids=req.origin_input_ids,
                   sampling_params=req.sampling_params, **extra)

    real = Driver._req
    monkeypatch.setattr(Driver, "_req", in_namespace)
    _installed(install_adapters)
    cpu, drv, prompt = _setup("python")
    req = _arrive(drv, prompt)
    assert req.extra_key is not None or req.cache_salt is not None
    stock = req.prefix_len
    root = drv.cache.root_node_handle(req.extra_key)
    adder = drv.adder()
    adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
    plan = swa_cone.state().plans[req.rid]
    assert plan.F - plan.s == N and plan.s > stock and req.prefix_len == plan.s
    # the request's lock holds the namespace's path to F
    assert drv.cache.tree_core.collect_full_device_indices(req.lock.node, root).numel() >= plan.F
    # a request of the default namespace with the same tokens finds none of it
    monkeypatch.setattr(Driver, "_req", real)
    other = _arrive(drv, prompt)
    assert other.prefix_len == 0 and getattr(other, "_dsv41_cone_candidate", None) is None


def _match(drv, prompt):
    """The engine's own match of the prompt (the stock result cone reads) and its params."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from array import array

    params = MatchPrefixParams(key=RadixKey(array("q", prompt[:-1]), None))
    return params, drv.cache.match_prefix(params)


def test_a_disabled_cache_or_one_without_swa_gives_no_candidate(install_adapters, caplog):
    """Cone's candidate step on the engine's match result of a lost resume point (F resident),
    asked for the same result on a disabled radix cache and on a radix cache without an SWA
    component: no candidate, nothing counted or logged; on the cache that produced it, one."""
    from adapter import swa_cone
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    _installed(install_adapters)
    cpu, drv, prompt = _setup("python")
    params, result = _match(drv, prompt)
    assert result.swa_branching_seqlen is not None          # the resume point is lost, F resident
    disabled = UnifiedRadixCache(CacheInitParams(
        disable=True, req_to_token_pool=cpu.req_to_token_pool, token_to_kv_pool_allocator=cpu.allocator,
        page_size=cpu.page_size, sliding_window_size=cpu.window,
        tree_components=(ComponentType.FULL, ComponentType.SWA), tree_core_backend="python"))
    no_swa = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                        token_to_kv_pool_allocator=None, page_size=cpu.page_size))
    assert disabled.disable and disabled.supports_swa() and not no_swa.supports_swa()
    cone = swa_cone.state()
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        assert cone.candidate(disabled, params, result) is None
        assert cone.candidate(no_swa, params, result) is None
    assert not [r for r in caplog.records if "swa_cone fallback" in r.getMessage()]
    assert not any(receipts.counters["swa_cone"].values())
    cand = cone.candidate(drv.cache, params, result)         # the control: the same result, planned
    assert cand is not None and cand.F == result.swa_branching_seqlen


def test_a_re_match_that_finds_no_node_at_s_alone_gives_no_candidate(install_adapters, monkeypatch,
                                                                     caplog):
    """The engine's match found the node at F; a fault injected into the re-match's walk alone
    (the key cut at s) reports no node: no candidate, the fallback line says why."""
    from adapter import swa_cone

    _installed(install_adapters)
    cpu, drv, prompt = _setup("python")
    params, result = _match(drv, prompt)
    assert result.last_visited_node_id is not None
    real = drv.cache._match_tree
    monkeypatch.setattr(drv.cache, "_match_tree",
                        lambda p: real(p)._replace(last_visited_node_id=None))
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        assert swa_cone.state().candidate(drv.cache, params, result) is None
    assert receipts.counters["swa_cone"]["fallback:re-match on full KV found no node; stock match "
                                         "kept"] == 1
    assert receipts.counters["swa_cone"]["candidates"] == 0
