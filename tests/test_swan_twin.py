"""swan's CPU twin (adapter/swan/twin.py): the router's kernel in a process without CUDA.

Through the production installer on the engine's real SM12x decode entry, with the engine's
production backend (`flashinfer`): the stock route is the engine's own split
(`_split_kv_pages_to_64`) and decode, with the CPU stand-ins of adapter/cpu/dsv4/flash_mla.py for
its Triton kernels and FlashInfer's entry. A decode call routing serves goes to the twin, which
reads the 256-token pages in place through swan's page view (the pool's own storage, stride(0)
149,760) and answers what the stock split route answers; the split is never reached; routing's
device and capability checks take the twin's caps (CPU tensors, only those); on a process with
CUDA the real module is the kernel and routing is as before.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from adapter import receipts, swan
from test_cpu_dsv4_flash_mla import _call, engine  # noqa: F401 - a fixture
from test_swan_routing import CPU_TWIN_CAPS, _mutate, _pool, engine_call, fake_module, on_sm121  # noqa: F401


@pytest.fixture
def twin_router(install_adapters, fake_module, engine, monkeypatch):  # noqa: F811
    """swan installed in this (CUDA-less) process; the engine entry on its flashinfer backend.
    The served path itself: without the first-use self-check, whose one stock call per key would
    reach the split (tests/test_swan_selfcheck.py runs the twin with it)."""
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_SWAN_SELFCHECK": "0"})["swan"]
    assert state.status == "installed", state.detail
    monkeypatch.setattr(engine, "_sm120_default_backend", "flashinfer")
    receipts.forget("swan")
    return swan.ROUTER, state


def test_without_cuda_the_twin_is_the_kernel_and_the_receipt_says_so(twin_router):
    router, state = twin_router
    assert not torch.cuda.is_available()
    assert isinstance(router.kernel, swan.Twin) and router.kernel_name() == "CPU twin"
    assert router.caps == swan.ModuleCaps(heads=router.info.heads, archs=router.info.archs, device="cpu")
    assert "; kernel CPU twin (no CUDA in this process: the engine's torch sparse decode" in state.detail
    assert "swan256.so is not run" in state.detail and "engine SM120 backend" in state.detail


@pytest.mark.parametrize("rows, extra", [(1, False), (4, True), (64, True)])
def test_served_calls_equal_the_stock_split_route_and_never_split(twin_router, engine, monkeypatch,  # noqa: F811
                                                                  caplog, rows, extra):
    router, _ = twin_router
    g = torch.Generator().manual_seed(rows)
    kw = _call(g, rows, extra=extra)
    want = _stock_route(engine, kw)          # the engine's split route, outside the router

    def no_split(*_a, **_k):
        raise AssertionError("the stock split was reached")

    seen = []
    real_decode = engine._sm120_sparse_decode_fwd

    def decode(q, k_cache, *a, **k):
        seen.append((k_cache.untyped_storage().data_ptr(), tuple(k_cache.shape), k_cache.stride()))
        return real_decode(q, k_cache, *a, **k)

    monkeypatch.setattr(engine, "_split_kv_pages_to_64", no_split)
    monkeypatch.setattr(engine, "_sm120_sparse_decode_fwd", decode)
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        got = [engine.flash_mla_with_kvcache_sm120(**kw) for _ in range(3)]
    for out, lse in got:
        assert lse is None and torch.equal(out, want)
    pool = kw["k_cache"]
    # in place: the pool's own storage, through the page view [N, 256, 1, 584], stride(0) 149,760
    assert seen == [(pool.untyped_storage().data_ptr(), (pool.shape[0], 256, 1, 584),
                     (swan.PAGE_STRIDE, 584, 584, 1))] * 3
    assert receipts.counters["swan"]["served"] == 3
    assert not [k for k in receipts.counters["swan"] if k.startswith("fallback:")]
    first = [r.getMessage() for r in caplog.records if "first in-place decode" in r.getMessage()]
    assert first == [f"[dsv41] swan first in-place decode: {rows} rows, 8 heads, topk 128; kernel CPU "
                     "twin (the engine's torch sparse decode, no split-K chunking)"]


def _stock_route(engine, kw):
    """The engine's stock flashinfer route on CPU (split + stand-in), called directly."""
    return engine._flash_mla_flashinfer(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"],
                                        kw["attn_sink"], kw["head_dim_v"], kw["softmax_scale"],
                                        kw["extra_k_cache"], kw["extra_indices_in_kvcache"],
                                        kw["extra_topk_length"])[0]


def test_prefill_rows_and_unservable_calls_keep_the_stock_split(twin_router, engine, capfd):  # noqa: F811
    router, _ = twin_router
    g = torch.Generator().manual_seed(9)
    prefill = _call(g, 70)
    want = engine._sm120_sparse_decode_fwd(prefill["q"], prefill["k_cache"], prefill["indices"],
                                           prefill["topk_length"], prefill["attn_sink"], 512,
                                           prefill["softmax_scale"], prefill["extra_k_cache"],
                                           prefill["extra_indices_in_kvcache"],
                                           prefill["extra_topk_length"])[0]
    assert torch.equal(engine.flash_mla_with_kvcache_sm120(**prefill)[0], want)
    # a decode call on an already-split (64-token) view: routing refuses it, stock runs it
    split = _call(g, 2, extra=False)
    split["k_cache"] = engine._split_kv_pages_to_64(split["k_cache"].view(torch.uint8), 256) \
        .view(torch.float8_e4m3fn)
    engine.flash_mla_with_kvcache_sm120(**split)
    counts = receipts.counters["swan"]
    assert counts["served"] == 0
    assert counts["fallback:more than 64 query rows (engine prefill path)"] == 1
    assert counts["fallback:k_cache pages are [64, 1, 584], not [256, 1, 584]"] == 1
    assert "dsv4 page split: prefill, 70 rows" in capfd.readouterr().err


def test_twin_caps_serve_cpu_tensors_and_only_those():
    kw = engine_call()
    cpu = swan.describe_call((), kw, "flashinfer")
    assert swan.route(cpu, CPU_TWIN_CAPS) is None
    assert swan.route(cpu, swan.ModuleCaps()) == "tensors on cpu, not CUDA"        # the module's
    cuda = on_sm121(cpu)
    assert swan.route(cuda, CPU_TWIN_CAPS) == "tensors on cuda, not CPU"
    assert swan.route(cuda, swan.ModuleCaps()) is None
    mixed = dataclasses.replace(cpu, attn_sink=dataclasses.replace(cpu.attn_sink, device="cuda"))
    assert swan.route(mixed, CPU_TWIN_CAPS) == "call mixes CPU and non-CPU tensors"
    # no compute capability on CPU: not checked; every layout check is the module's
    assert cpu.capability is None
    assert "k_cache pages are [64, 1, 584]" in swan.route(
        swan.describe_call((), _mutate(kw, k_cache=_pool(page_tokens=64)[1]), "flashinfer"), CPU_TWIN_CAPS)
    assert "module built without" in swan.route(cpu, dataclasses.replace(CPU_TWIN_CAPS, heads=(64,)))
    assert "q dtype float16" in swan.route(
        swan.describe_call((), _mutate(kw, q=kw["q"].half()), "flashinfer"), CPU_TWIN_CAPS)


def test_with_cuda_the_module_is_the_kernel(install_adapters, fake_module, engine, monkeypatch,  # noqa: F811
                                           caplog):
    """A process with CUDA (simulated: the .so cannot load here) gets the module's Kernel and the
    module's caps; the twin is not used; the first served call's line names the module."""
    loaded = []

    class ModuleKernel:
        NAME = "swan256.so"

        def __init__(self, info):
            loaded.append(info)

        def plan(self, facts, kwargs):
            return swan.Plan(None, {"cpb": 2})

        def run(self, plan, kwargs):
            return ("module", None)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(swan, "Kernel", ModuleKernel)
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_SWAN_SELFCHECK": "0"})["swan"]
    assert state.status == "installed", state.detail
    router = swan.ROUTER
    assert isinstance(router.kernel, ModuleKernel) and len(loaded) == 1
    assert router.kernel_name() == "swan256.so"
    assert router.caps == swan.ModuleCaps(heads=router.info.heads, archs=router.info.archs)
    assert "; kernel swan256.so (loaded); " in state.detail and "CPU twin" not in state.detail
    # a call the module's routing serves (CUDA facts cannot exist here: routing is stood in)
    monkeypatch.setattr(engine, "_sm120_default_backend", "flashinfer")
    monkeypatch.setattr(swan, "route", lambda facts, caps: None)
    receipts.forget("swan")
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        assert engine.flash_mla_with_kvcache_sm120(**_call(torch.Generator().manual_seed(1), 2)) == ("module", None)
    assert [r.getMessage() for r in caplog.records if "first in-place" in r.getMessage()] == [
        "[dsv41] swan first in-place decode: 2 rows, 8 heads, topk 128, cpb 2; kernel swan256.so"]
