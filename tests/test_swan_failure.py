"""swan: an exception in routing or in the kernel launch never reaches the engine (issue 30).

Through the production installer on the engine's real SM12x decode entry (CPU: the engine's torch
SM120 backend computes the stock answer). A routing step or a launch made to raise gives one
fallback line per reason, the call goes to the stock entry and returns exactly what stock returns;
nothing of the engine's was written (the kernel writes only buffers it allocates), and no call is
counted as served.
"""
from __future__ import annotations

import logging

import pytest
import torch

from adapter import receipts, swan
from test_swan_routing import _real_call as _call, fake_module  # noqa: F401 - a fixture


@pytest.mark.parametrize("step", ["route", "plan", "launch"])
@pytest.mark.parametrize("exc", [torch.OutOfMemoryError, RuntimeError, ValueError])
def test_a_failing_route_or_launch_gives_the_stock_answer(install_adapters, fake_module, monkeypatch,
                                                          caplog, step, exc):
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    kw = _call()
    monkeypatch.setattr(m, "_sm120_default_backend", "torch")      # the stock path CPU runs
    stock = m.flash_mla_with_kvcache_sm120
    expected = stock(**kw)[0]
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1"})["swan"]
    assert state.status == "installed", state.detail
    router = swan.ROUTER
    snapshot = {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}

    def boom(*a, **k):
        raise exc("planted")

    class Kernel:
        def plan(self, facts, kwargs):
            if step == "plan":
                boom()
            return swan.Plan(None, {"cpb": 1})

        def run(self, plan, kwargs):
            if step == "launch":
                boom()
            return ("in place", None)

    monkeypatch.setattr(router, "kernel", Kernel())
    # every call routes as a served flashinfer decode, except where a step is made to fail
    monkeypatch.setattr(router, "backend", lambda: "flashinfer")
    monkeypatch.setattr(swan, "route", boom if step == "route" else (lambda facts, caps: None))
    monkeypatch.setattr(router, "_python_decision", lambda args, kwargs: (
        (None, router._decide(args, kwargs, "flashinfer"))))
    monkeypatch.setattr(router, "native", type("NoKey", (), {
        "lookup": staticmethod(lambda kwargs, table: None)})())
    monkeypatch.setattr(router, "hook", router._make_hook())      # over the patched pieces
    receipts.forget("swan")
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        out = router.hook(stock, **kw)
    assert torch.equal(out[0], expected)
    assert all(torch.equal(kw[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else kw[k],
                           v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v)
               for k, v in snapshot.items())                        # the engine's tensors untouched
    counts = receipts.counters["swan"]
    assert counts["served"] == 0
    want = ("kernel launch failed" if step == "launch" else "internal error in routing") + \
        f" ({exc.__name__}); this call keeps the stock split"
    assert counts[f"fallback:{want}"] == 1
    assert any(want in r.getMessage() for r in caplog.records)
