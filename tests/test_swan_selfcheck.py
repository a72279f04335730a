"""swan's self-check at first use (adapter/swan/selfcheck.py, DSV41_SWAN_SELFCHECK; issue 33).

Through the production installer on the engine's real SM12x decode entry, on its production
backend (`flashinfer`: the engine's own split route, with the CPU stand-ins of
adapter/cpu/dsv4/flash_mla.py), the router's kernel being the CPU twin:
  * the first call of a new decode key runs in place and stock, compares the bits, and the key is
    served in place from then on (one stock call per key; the answer is stock's, bit-identical);
  * a planted one-byte error in the in-place read (DSV41_SWAN_SELFCHECK_TEST_PLANT) fails the
    key: the fallback line names the key, the first differing element and both values, the
    counter counts it, every call of the key answers stock's bits; without the check (key 0)
    the planted error reaches the answer (the control: the test can fail);
  * DSV41_SWAN_SELFCHECK=2 turns swan off as a whole; under CUDA-graph capture the key stays
    pending; errors in the check are contained;
  * the agreement, over a real torch.distributed gloo group of two processes: a difference on
    one rank only makes both ranks fall back; with the agreement replaced by each rank's own
    verdict, the ranks diverge (one serves in place, the other does not); ranks checking
    different keys fall back.
"""
from __future__ import annotations

import logging

import pytest
import torch

from adapter import receipts, swan
from adapter.swan import selfcheck
from conftest import run_two_ranks_modes
from swan_module_dir import write_module
from test_cpu_dsv4_flash_mla import _call, _torch_decode, engine  # noqa: F401 - a fixture
from test_swan_routing import fake_module  # noqa: F401 - a fixture
from test_swan_twin import _stock_route

SWAN = {"DSV41_SWA_NATIVE_DECODE": "1"}


@pytest.fixture
def checked(install_adapters, fake_module, engine, monkeypatch):  # noqa: F811
    """install(keys) -> the router: swan installed with `keys` in this (CUDA-less) process, the
    engine entry on its flashinfer backend, a spy on the engine's split."""
    splits = []
    real_split = engine._split_kv_pages_to_64

    def install(keys=None):
        monkeypatch.setattr(engine, "_split_kv_pages_to_64", real_split)     # its pin, at install
        state = install_adapters({**SWAN, **(keys or {})})["swan"]
        assert state.status == "installed", state.detail
        monkeypatch.setattr(engine, "_sm120_default_backend", "flashinfer")
        monkeypatch.setattr(engine, "_split_kv_pages_to_64",
                            lambda *a, **k: splits.append(1) or real_split(*a, **k))
        receipts.forget("swan")
        router = swan.ROUTER
        router.splits = splits
        return router

    return install


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# --- the comparison ---------------------------------------------------------------------------

def test_compare_names_the_first_differing_element_and_both_values():
    a = torch.zeros(2, 1, 3, 4, dtype=torch.bfloat16)
    b = a.clone()
    assert selfcheck.compare((a, None), (b, None)) is None
    b[1, 0, 2, 1] = 1.0
    b[1, 0, 2, 3] = 2.0
    assert selfcheck.compare((a, None), (b, None)) == (
        "output[1, 0, 2, 1] in-place 0 (0x0000) != stock 1 (0x3f80) (2 of 24 elements differ)")
    # bits, not values: -0.0 is not 0.0, a NaN equals the same NaN
    assert selfcheck.compare(torch.tensor([-0.0]), torch.tensor([0.0])) == (
        "output[0] in-place -0 (0x80000000) != stock 0 (0x00000000) (1 of 1 elements differ)")
    nan = torch.tensor([float("nan")])
    assert selfcheck.compare(nan, nan.clone()) is None
    # the LSE where the entry returns one; shapes, dtypes, None and arity
    lse = torch.ones(2, 3)
    assert selfcheck.compare((a, lse), (a, lse.clone())) is None
    assert selfcheck.compare((a, lse), (a, lse + 1)).startswith("lse[0, 0] in-place 1 (0x3f800000) != stock 2")
    assert selfcheck.compare((a, None), (a, lse)) == "lse: in-place None, stock a tensor"
    assert selfcheck.compare(a.float(), a) == "output: in-place float32[2, 1, 3, 4], stock bfloat16[2, 1, 3, 4]"
    assert selfcheck.compare((a,), (a, None)) == "in-place returned tuple, stock tuple"


def test_planted_kwargs_change_one_byte_of_a_copy_that_a_row_attends(engine):  # noqa: F811
    kw = _call(torch.Generator().manual_seed(3), 2, extra=False)
    pool = kw["k_cache"]
    before = pool.view(torch.uint8).clone()
    planted, where = selfcheck.planted_kwargs(kw)
    copy = planted["k_cache"]
    assert torch.equal(pool.view(torch.uint8), before)                       # the pool untouched
    assert copy.untyped_storage().data_ptr() != pool.untyped_storage().data_ptr()
    assert (copy.shape, copy.stride(), copy.dtype) == (pool.shape, pool.stride(), pool.dtype)
    full = lambda t: torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())  # noqa: E731
    diff = (full(copy) != full(pool)).nonzero().flatten().tolist()
    # _call gives row 0 no candidate (topk_length 0): the first token row 1 attends
    assert int(kw["topk_length"][0]) == 0
    token = next(int(t) for t in kw["indices"][1, 0, :int(kw["topk_length"][1])] if t >= 0)
    page, slot = divmod(token, 256)
    at = page * swan.PAGE_STRIDE + 256 * 576 + slot * 8              # its tile-0 scale exponent
    assert diff == [at]
    old, new = int(full(pool)[at]), int(full(copy)[at])
    assert new == min(old + 32, 0xFE) and new != old
    assert where == f"token {token} (page {page}, slot {slot}): its tile-0 scale byte {at} 0x{old:02x} -> 0x{new:02x}"
    # and it changes what that row decodes
    assert not torch.equal(_torch_decode(engine, planted)[0][1], _torch_decode(engine, kw)[0][1])


# --- one process: the check, the plant, the modes ---------------------------------------------

def test_each_new_key_is_checked_once_then_served_in_place(checked, engine, caplog):  # noqa: F811
    router = checked()
    assert router.check_mode == selfcheck.PER_KEY
    g = torch.Generator().manual_seed(5)
    calls = {rows: _call(g, rows, extra=extra) for rows, extra in ((1, False), (4, True))}
    want = {rows: _stock_route(engine, kw) for rows, kw in calls.items()}
    router.splits.clear()
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        got = {rows: [engine.flash_mla_with_kvcache_sm120(**kw) for _ in range(3)]
               for rows, kw in calls.items()}
    for rows, outs in got.items():
        assert all(lse is None and torch.equal(out, want[rows]) for out, lse in outs)
    counts = receipts.counters["swan"]
    # one stock call (with its split) per key, the other calls in place
    assert len(router.splits) == 2
    assert counts[selfcheck.VERIFIED] == 2 and counts["served"] == 4 and not counts[selfcheck.FAILED]
    assert not [k for k in counts if k.startswith("fallback:")]
    assert _messages(caplog, "self-check verified") == [
        "[dsv41] swan self-check verified key 1 (1 rows, 8 heads, topk 128, k_cache [4, 256, 1, 584]): "
        "in-place output bit-identical to the stock split's, agreed by the TP group (1 ranks) (1 verified, 0 failed)",
        "[dsv41] swan self-check verified key 2 (4 rows, 8 heads, topk 128, extra topk 64, k_cache "
        "[4, 256, 1, 584], extra_k_cache [3, 64, 1, 584]): in-place output bit-identical to the stock "
        "split's, agreed by the TP group (1 ranks) (2 verified, 0 failed)"]
    # prefill rows are never keyed: no check, the split as before
    engine.flash_mla_with_kvcache_sm120(**_call(g, 70, extra=False))
    assert counts[selfcheck.VERIFIED] == 2 and router.checks == 2


def test_the_receipt_says_the_check_is_on_or_off(checked):
    assert "; self-check on (DSV41_SWAN_SELFCHECK=1): each new decode key's first call runs in place " \
           "and stock, bit-compared, the verdict agreed by every TP rank; a key that differs keeps " \
           "the stock split; other calls keep the stock split" in _detail(checked)
    assert "; self-check off (DSV41_SWAN_SELFCHECK=0): new decode keys are served unchecked; " \
           in _detail(checked, {"DSV41_SWAN_SELFCHECK": "0"})
    assert "keeps the stock split and turns swan off (TEST ONLY DSV41_SWAN_SELFCHECK_TEST_PLANT=0);" \
           in _detail(checked, {"DSV41_SWAN_SELFCHECK": "2", "DSV41_SWAN_SELFCHECK_TEST_PLANT": "0"})


def _detail(checked, keys=None):
    from adapter import installer

    checked(keys)
    return installer.status()["swan"].detail


@pytest.mark.parametrize("check", ["on", "off (control)"])
def test_a_planted_error_fails_its_key_and_every_answer_stays_stock(checked, engine, caplog, check):  # noqa: F811
    keys = {"DSV41_SWAN_SELFCHECK_TEST_PLANT": "0"}
    if check != "on":
        keys["DSV41_SWAN_SELFCHECK"] = "0"
    router = checked(keys)
    kw = _call(torch.Generator().manual_seed(7), 2, extra=True)
    want = _stock_route(engine, kw)
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        outs = [engine.flash_mla_with_kvcache_sm120(**kw)[0] for _ in range(3)]
    counts = receipts.counters["swan"]
    planted = _messages(caplog, "planted one-byte error")
    assert len(planted) == 1 and planted[0].startswith(
        "[dsv41] swan TEST ONLY DSV41_SWAN_SELFCHECK_TEST_PLANT=0: the in-place read on this TP rank "
        "has a planted one-byte error (token "), planted
    if check != "on":
        # the control: without the check the planted read is served, and its answer is not stock's
        assert counts["served"] == 3 and not all(torch.equal(o, want) for o in outs)
        return
    assert all(torch.equal(o, want) for o in outs)
    assert counts["served"] == 0 and counts[selfcheck.FAILED] == 1 and not counts[selfcheck.VERIFIED]
    reasons = [k for k in counts if k.startswith("fallback:")]
    assert len(reasons) == 1 and counts[reasons[0]] == 3
    line = _messages(caplog, "swan fallback: self-check failed")
    assert len(line) == 1, line
    assert line[0].startswith(
        "[dsv41] swan fallback: self-check failed for key 2 rows, 8 heads, topk 128, extra topk 64, "
        "k_cache [4, 256, 1, 584], extra_k_cache [3, 64, 1, 584]: output[")
    assert " in-place " in line[0] and " != stock " in line[0] and " elements differ); this key " \
        "keeps the stock split on every TP rank (logged once)" in line[0]
    assert router.failed == 1 and router.verified == 0


def test_selfcheck_2_turns_swan_off_as_a_whole(checked, engine, monkeypatch, caplog):  # noqa: F811
    router = checked({"DSV41_SWAN_SELFCHECK": "2"})
    g = torch.Generator().manual_seed(11)
    good, bad, later = _call(g, 2, extra=False), _call(g, 3, extra=False), _call(g, 5, extra=False)
    run = router.kernel.run

    def wrong_for_3_rows(plan, kwargs):          # the in-place answer of one key is off by one bit
        out, lse = run(plan, kwargs)
        if kwargs["q"].shape[0] == 3:
            out = out.clone()
            out.view(torch.int16).reshape(-1)[5] ^= 1
        return out, lse

    monkeypatch.setattr(router.kernel, "run", wrong_for_3_rows)
    for _ in range(2):
        engine.flash_mla_with_kvcache_sm120(**good)
    counts = receipts.counters["swan"]
    assert counts["served"] == 1 and counts[selfcheck.VERIFIED] == 1
    with caplog.at_level(logging.INFO, logger=receipts.LOGGER_NAME):
        assert torch.equal(engine.flash_mla_with_kvcache_sm120(**bad)[0], _stock_route(engine, bad))
        for kw in (good, later):                 # a verified key and a new key: both stock now
            assert torch.equal(engine.flash_mla_with_kvcache_sm120(**kw)[0], _stock_route(engine, kw))
    assert counts["served"] == 1 and counts[selfcheck.FAILED] == 1 and router.checks == 2
    off = [k for k in counts if k.startswith("fallback:swan off after a failed self-check")]
    # the failing call, then the verified key and the new key
    assert len(off) == 1 and counts[off[0]] == 3, dict(counts)
    assert "output[0, 0, 0, 5] in-place" in off[0]


def test_under_graph_capture_a_new_key_stays_pending(checked, engine, monkeypatch):  # noqa: F811
    router = checked()
    kw = _call(torch.Generator().manual_seed(13), 2, extra=False)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    want = _stock_route(engine, kw)
    assert torch.equal(engine.flash_mla_with_kvcache_sm120(**kw)[0], want)
    counts = receipts.counters["swan"]
    assert counts[f"fallback:{selfcheck.CAPTURE_REASON}"] == 1 and router.checks == 0
    capturing[0] = False                          # the next call outside a capture checks it
    engine.flash_mla_with_kvcache_sm120(**kw)
    engine.flash_mla_with_kvcache_sm120(**kw)
    assert router.checks == 1 and counts[selfcheck.VERIFIED] == 1 and counts["served"] == 1


@pytest.mark.parametrize("step", ["launch", "agreement"])
def test_an_error_in_the_check_is_contained_and_the_key_stays_stock(checked, engine, monkeypatch, step):  # noqa: F811
    router = checked()
    kw = _call(torch.Generator().manual_seed(17), 2, extra=False)

    def boom(*a, **k):
        raise RuntimeError("planted")

    if step == "launch":
        monkeypatch.setattr(router.kernel, "run", boom)
    else:
        monkeypatch.setattr(router, "group", boom)
    want = _stock_route(engine, kw)
    for _ in range(2):
        assert torch.equal(engine.flash_mla_with_kvcache_sm120(**kw)[0], want)
    counts = receipts.counters["swan"]
    assert counts["served"] == 0 and counts[selfcheck.FAILED] == 1
    reason = next(k for k in counts if k.startswith("fallback:"))
    what = "in-place kernel launch failed (RuntimeError)" if step == "launch" else "no TP agreement (RuntimeError)"
    assert f": {what}; this key keeps the stock split on every TP rank" in reason and counts[reason] == 2


# --- the agreement over a real gloo group of two processes ------------------------------------

# runs after conftest.TWO_RANKS_PREAMBLE (rank, mode, out, dist, tests/ on the path)
CHILD = r"""
import torch

from adapter import installer, receipts, swan
from adapter.cpu.dsv4 import flash_mla
from adapter.swan import selfcheck
from sglang.kernels.ops.attention import flash_mla_sm120 as m
from test_cpu_dsv4_flash_mla import _call

# the engine's flashinfer route with the CPU stand-ins, as the CPU server arms them
m._page_mark_kernel, m._page_split_kernel = flash_mla.page_mark_kernel, flash_mla.page_split_kernel
sys.modules[flash_mla.FLASHINFER_MODULE] = flash_mla.flashinfer_module()
installer.set_mode("report")
state = installer.install_in_process({"DSV41_SWA_NATIVE_DECODE": "1",
                                      "DSV41_SWAN_SELFCHECK_TEST_PLANT": "0"})["swan"]
assert state.status == "installed", state.detail
m._sm120_default_backend = "flashinfer"
router = swan.ROUTER
group = dist.new_group([0, 1], backend="gloo")
router.group = lambda: (group, 2, rank)                # the engine's attention-TP CPU group
if mode == "local":                                    # the agreement replaced: each rank alone
    selfcheck.agree = lambda differs, refused, fp, group, world, reduce=None: (differs, refused, False)
rows = 2 if mode != "out-of-step" or rank == 0 else 3  # out-of-step: the ranks check other keys
kw = _call(torch.Generator().manual_seed(23), rows, extra=True)       # the same call on both ranks
want = m._flash_mla_flashinfer(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"],
                               kw["attn_sink"], 512, kw["softmax_scale"], kw["extra_k_cache"],
                               kw["extra_indices_in_kvcache"], kw["extra_topk_length"])[0]
equal = [torch.equal(m.flash_mla_with_kvcache_sm120(**kw)[0], want) for _ in range(3)]
counts = receipts.counters["swan"]
json.dump({"equal": equal, "served": counts["served"], "verified": counts[selfcheck.VERIFIED],
           "failed": counts[selfcheck.FAILED],
           "fallbacks": {k[len("fallback:"):]: v for k, v in counts.items() if k.startswith("fallback:")}},
          open(out, "w"))
dist.destroy_process_group()
"""


# CHILD's imports, once per rank (conftest.run_two_ranks_modes forks a child per mode)
PRELOAD = """
import sys
sys.path.insert(0, "tests")
import torch
from adapter import installer, receipts, swan
from adapter.cpu.dsv4 import flash_mla
from adapter.swan import selfcheck
from sglang.kernels.ops.attention import flash_mla_sm120
import test_cpu_dsv4_flash_mla
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{mode: [rank 0's JSON, rank 1's JSON]} for the three modes below, run once, over a module
    directory that passes verify_module (test_swan_routing's fake_module, made once here)."""
    module_dir = tmp_path_factory.mktemp("swan-module")
    write_module(module_dir, b"\x7fELF stand-in for tests " * 64)
    return run_two_ranks_modes(CHILD, tmp_path_factory.mktemp("swan-ranks"),
                               ["agree", "local", "out-of-step"], PRELOAD,
                               env={swan.MODULE_DIR_ENV: str(module_dir)})


def test_a_difference_on_one_rank_makes_every_rank_fall_back(ranks):
    """Rank 0 has the planted error, rank 1 does not: with the agreement both keep the stock split
    for that key (every answer stock's); rank 1 says its own bits were equal."""
    r0, r1 = ranks["agree"]
    for r in (r0, r1):
        assert r["equal"] == [True] * 3 and r["served"] == 0 and r["failed"] == 1 and r["verified"] == 0, r
    (why0, n0), = r0["fallbacks"].items()
    (why1, n1), = r1["fallbacks"].items()
    assert n0 == n1 == 3
    assert why0.startswith("self-check failed for key 2 rows, 8 heads, topk 128, extra topk 64, ")
    assert " in-place " in why0 and " != stock " in why0
    assert why1.endswith(": equal on this TP rank, different on another; this key keeps the stock "
                         "split on every TP rank")


def test_without_the_agreement_the_ranks_diverge(ranks):
    """The control of the one above: the agreement replaced by each rank's own verdict, rank 0
    falls back and rank 1 serves the key in place: the two ranks run different kernels."""
    r0, r1 = ranks["local"]
    assert r0["served"] == 0 and r0["failed"] == 1
    assert r1["served"] == 2 and r1["verified"] == 1 and not r1["fallbacks"]


def test_ranks_checking_different_keys_fall_back(ranks):
    r0, r1 = ranks["out-of-step"]
    for r in (r0, r1):
        assert r["served"] == 0 and r["failed"] == 1, r
        (why, _), = r["fallbacks"].items()
        assert why.startswith("self-check: the TP ranks checked different keys at check 1"), why
