"""swan routing: which decode calls the swan256 module serves in place, and the fallback reasons.

Routing is a pure function of the call's tensor metadata (adapter.swan.route); these tests build
the engine-shaped call on CPU tensors and present them as CUDA tensors of an sm_121 device (the
only thing that cannot exist here). The hook itself is tested through the production installer
on the real engine entry `flash_mla_with_kvcache_sm120`.
"""
import dataclasses
import logging

import pytest
import torch

from adapter import swan
from swan_module_dir import write_module

POOL_PAGES = 5


def _pool(pages=POOL_PAGES, page_tokens=256):
    stride = swan.PAGE_STRIDE if page_tokens == 256 else swan.SPLIT_PAGE_STRIDE
    raw = torch.zeros(pages * stride, dtype=torch.uint8)
    return raw, raw.as_strided((pages, page_tokens, 1, swan.ROW_BYTES),
                               (stride, swan.ROW_BYTES, swan.ROW_BYTES, 1)).view(torch.float8_e4m3fn)


def engine_call(rows=4, heads=16, topk=128, extra=True, extra_topk=512):
    """Keyword arguments as deepseek_v4_backend passes them to flash_mla_with_kvcache_sm120."""
    _, k_cache = _pool()
    kw = dict(q=torch.zeros(rows, 1, heads, 512, dtype=torch.bfloat16), k_cache=k_cache,
              head_dim_v=512, softmax_scale=512 ** -0.5,
              indices=torch.full((rows, 1, topk), -1, dtype=torch.int32),
              topk_length=torch.full((rows,), topk, dtype=torch.int32),
              attn_sink=torch.zeros(heads, dtype=torch.float32),
              extra_k_cache=None, extra_indices_in_kvcache=None, extra_topk_length=None)
    if extra:
        _, extra_cache = _pool(pages=3, page_tokens=64)
        kw.update(extra_k_cache=extra_cache,
                  extra_indices_in_kvcache=torch.full((rows, 1, extra_topk), -1, dtype=torch.int32),
                  extra_topk_length=torch.full((rows,), extra_topk, dtype=torch.int32))
    return kw


def on_sm121(facts: swan.CallFacts, capability=(12, 1)) -> swan.CallFacts:
    moved = {f.name: dataclasses.replace(getattr(facts, f.name), device="cuda")
             for f in dataclasses.fields(facts) if isinstance(getattr(facts, f.name), swan.TensorFacts)}
    return dataclasses.replace(facts, capability=capability, **moved)


def decide(kw, backend="flashinfer", caps=swan.ModuleCaps(), capability=(12, 1), args=()):
    return swan.route(on_sm121(swan.describe_call(args, kw, backend), capability), caps)


@pytest.mark.parametrize("rows", [1, 4, 16, 64])
@pytest.mark.parametrize("heads", [8, 16, 64, 128])
@pytest.mark.parametrize("extra", [False, True])
def test_decode_shapes_are_served(rows, heads, extra):
    assert decide(engine_call(rows=rows, heads=heads, extra=extra)) is None


def test_runtime_head_kernel_serves_other_head_counts():
    assert swan.kernel_heads(12) == 0 and swan.kernel_heads(16) == 16
    assert decide(engine_call(heads=12)) is None
    no_runtime = swan.ModuleCaps(heads=(8, 16, 32, 64, 128))
    assert "without the 0-head kernel" in decide(engine_call(heads=12), caps=no_runtime)


def _mutate(kw, **changes):
    out = dict(kw)
    out.update(changes)
    return out


def _cases():
    base = engine_call()
    raw, _ = _pool()
    return {
        "backend": (dict(kw=base, backend="triton"), "does not split pages"),
        "rows>64": (dict(kw=engine_call(rows=65)), "more than 64 query rows"),
        "sm_90": (dict(kw=base, capability=(9, 0)), "device sm_90"),
        "head_dim_v": (dict(kw=_mutate(base, head_dim_v=448)), "head_dim_v 448"),
        "q dtype": (dict(kw=_mutate(base, q=base["q"].half())), "q dtype float16"),
        "q width": (dict(kw=_mutate(base, q=torch.zeros(4, 1, 16, 576, dtype=torch.bfloat16))), "q shape"),
        "heads not built": (dict(kw=base, caps=swan.ModuleCaps(heads=(64,))), "16 heads: module built without"),
        "too many heads": (dict(kw=engine_call(heads=192)), "192 heads"),
        "2-D pool": (dict(kw=_mutate(base, k_cache=raw.view(POOL_PAGES, swan.PAGE_STRIDE))), "k_cache is 2-D"),
        "already split": (dict(kw=_mutate(base, k_cache=_pool(page_tokens=64)[1])), "k_cache pages are [64, 1, 584]"),
        "unpadded stride": (dict(kw=_mutate(base, k_cache=raw.as_strided(
            (POOL_PAGES, 256, 1, 584), (256 * 584, 584, 584, 1)))), "k_cache strides"),
        "pool dtype": (dict(kw=_mutate(base, k_cache=base["k_cache"].view(torch.int8))), "k_cache dtype int8"),
        "indices dtype": (dict(kw=_mutate(base, indices=base["indices"].long())), "indices dtype int64"),
        "indices width": (dict(kw=_mutate(base, indices=torch.zeros(4, 1, 100, dtype=torch.int32))), "indices width"),
        "topk_length dtype": (dict(kw=_mutate(base, topk_length=base["topk_length"].long())), "topk_length is not"),
        "sink length": (dict(kw=_mutate(base, attn_sink=torch.zeros(8))), "attn_sink is not"),
        "extra alone": (dict(kw=_mutate(base, extra_indices_in_kvcache=None)), "not given together"),
        "extra layout": (dict(kw=_mutate(base, extra_k_cache=torch.zeros(3, 64 * 584, dtype=torch.uint8))),
                         "extra_k_cache is not a 3-D"),
        "positional": (dict(kw=base, args=(1,)), "positional call"),
    }


CASES = _cases()


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_reasons(name):
    options, expected = CASES[name]
    reason = decide(**options)
    assert reason is not None and expected in reason, reason


def test_reasons_are_distinct_and_a_cpu_call_is_not_served():
    reasons = [decide(**options) for options, _ in CASES.values()]
    assert len(set(reasons)) == len(reasons)
    cpu = swan.route(swan.describe_call((), engine_call(), "flashinfer"), swan.ModuleCaps())
    assert cpu == "tensors on cpu, not CUDA"


def test_mixed_devices_fall_back():
    facts = on_sm121(swan.describe_call((), engine_call(), "flashinfer"))
    facts = dataclasses.replace(facts, extra_indices=dataclasses.replace(facts.extra_indices, device="cpu"))
    assert swan.route(facts, swan.ModuleCaps()) == "call mixes CUDA and non-CUDA tensors"


def test_tactic_must_match_the_stock_plan():
    stock = {"variant": 0, "implementation": "ordinary", "numeric_route": "fp8", "cpb": 2,
             "active_splits": 5, "scratch_split_stride": 10, "scratch_heads": 16,
             "block_threads": 288, "shared_bytes": 90000, "partial_bytes": 4096, "lse_bytes": 64}
    ours = dict(stock)
    assert swan.tactic_reason(stock, ours) is None
    assert "prefill variant 2" in swan.tactic_reason(dict(stock, variant=2), ours)
    assert "mixed" in swan.tactic_reason(dict(stock, implementation="mixed"), ours)
    for field in swan.COMPARED_FIELDS:
        assert field in swan.tactic_reason(stock, dict(ours, **{field: ours[field] + 1}))
    assert "could not plan" in swan.tactic_reason(stock, None)


# --- through the production installer, on the real engine entry ------------------------------

@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """A module directory that passes verify_module (a stand-in .so: nothing loads it on CPU; the
    real router key)."""
    write_module(tmp_path, b"\x7fELF stand-in for tests " * 64)
    monkeypatch.setenv(swan.MODULE_DIR_ENV, str(tmp_path))
    return tmp_path


def _real_call(rows=2, heads=16, topk=64):
    """A small real decode call (random pool, valid indices) the engine's torch path can run."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 120, (3 * swan.PAGE_STRIDE,), dtype=torch.uint8, generator=g)
    k_cache = raw.as_strided((3, 256, 1, 584), (swan.PAGE_STRIDE, 584, 584, 1)).view(torch.float8_e4m3fn)
    idx = torch.randint(0, 3 * 256, (rows, 1, topk), dtype=torch.int32, generator=g)
    return dict(q=torch.randn(rows, 1, heads, 512, generator=g).to(torch.bfloat16), k_cache=k_cache,
                head_dim_v=512, softmax_scale=512 ** -0.5, indices=idx,
                topk_length=torch.full((rows,), topk, dtype=torch.int32),
                attn_sink=torch.zeros(heads), extra_k_cache=None, extra_indices_in_kvcache=None,
                extra_topk_length=None)


def test_unserved_calls_reach_the_stock_entry_and_log_once(install_adapters, fake_module,
                                                           monkeypatch, caplog):
    from adapter import receipts
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    kw = _real_call()
    monkeypatch.setattr(m, "_sm120_default_backend", "torch")   # the stock path CPU can run
    expected = m.flash_mla_with_kvcache_sm120(**kw)[0]
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1"})["swan"]
    assert state.status == "installed", state.detail
    assert "kernel CPU twin" in state.detail and "sha256" in state.detail    # no CUDA here
    receipts.forget("swan")
    with caplog.at_level(logging.INFO, logger="sglang.dsv41"):
        outs = [m.flash_mla_with_kvcache_sm120(**kw)[0] for _ in range(3)]
    for out in outs:
        assert torch.equal(out, expected)
    reason = "engine SM120 backend is 'torch': it does not split pages"
    assert receipts.counters["swan"][f"fallback:{reason}"] == 3
    assert sum(reason in r.getMessage() for r in caplog.records) == 1   # one line per reason
    assert receipts.counters["swan"]["served"] == 0


def test_served_calls_skip_the_stock_split(install_adapters, fake_module, monkeypatch):
    """A call routing serves goes to the kernel layer; the stock entry (and its split) is never
    reached. The kernel layer is the one thing replaced: it needs an SM12x GPU."""
    from adapter import receipts
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    def no_split(*_a, **_k):
        raise AssertionError("stock split reached")

    # the served path itself: without the first-use self-check (its stock call would split;
    # tests/test_swan_selfcheck.py)
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_SWAN_SELFCHECK": "0"})["swan"]
    assert state.status == "installed", state.detail
    # after the install: its pin check reads the engine's own functions
    monkeypatch.setattr(m, "_split_kv_pages_to_64", no_split)
    monkeypatch.setattr(m, "_flash_mla_flashinfer", no_split)
    router = swan.ROUTER
    seen = []

    class KernelStandIn:
        def plan(self, facts, kwargs):
            seen.append(facts)
            return swan.Plan(None, {"cpb": 1})

        def run(self, plan, kwargs):
            return ("in place", None)

    monkeypatch.setattr(router, "kernel", KernelStandIn())
    monkeypatch.setattr(swan, "route", lambda facts, caps: None)
    receipts.counters["swan"].clear()
    assert m.flash_mla_with_kvcache_sm120(**_real_call()) == ("in place", None)
    assert receipts.counters["swan"]["served"] == 1 and len(seen) == 1
    # and a call routing refuses still goes to the stock entry (a decision is kept per call
    # key: forget them, as a new routing would start)
    monkeypatch.setattr(swan, "route", lambda facts, caps: "test reason")
    router.forget()
    with pytest.raises(AssertionError, match="stock split reached"):
        m.flash_mla_with_kvcache_sm120(**_real_call())
    assert receipts.counters["swan"]["fallback:test reason"] == 1


# --- the router's per-call path: a decision per decode key ----------------------------------

def _misaligned_q(rows=4, heads=16):
    buf = torch.zeros(rows * heads * 512 + 1, dtype=torch.bfloat16)
    return buf[1:].view(rows, 1, heads, 512)          # contiguous, data_ptr % 16 == 2


def _variants():
    """(name, call kwargs): served shapes, every fallback case, data-only twins, misalignment."""
    out = [(f"served {r}x{h} extra={e}", engine_call(rows=r, heads=h, extra=e))
           for r in (1, 4, 16, 64) for h in (8, 12, 16, 64, 128) for e in (False, True)]
    out += [(f"twin {i}", engine_call()) for i in range(3)]           # new tensors, same layout
    out += [(name, options["kw"]) for name, (options, _) in CASES.items()
            if set(options) == {"kw"}]
    out.append(("misaligned q", _mutate(engine_call(), q=_misaligned_q())))
    out.append(("no extra_topk_length", _mutate(engine_call(), extra_topk_length=None)))
    out.append(("extra_topk_length alone", _mutate(engine_call(extra=False),
                                                   extra_topk_length=torch.zeros(4, dtype=torch.int32))))
    return out


CPU_TWIN_CAPS = swan.ModuleCaps(device="cpu")


def test_equal_decode_keys_mean_equal_verdicts():
    """decode_key holds everything route() reads: calls with one key get one verdict (so the
    router may decide once per key), and a layout-only twin shares the key (so it does). The
    same holds for the CPU twin's caps (the CPU tensors themselves)."""
    by_key = {}
    for name, kw in _variants():
        shape = kw["q"].shape
        if swan.entry_reason(False, "flashinfer", True, shape[0] if shape else 0) is not None:
            continue                                  # never keyed (rows > 64)
        key = swan.decode_key(shape, kw)
        hash(key)
        on_cpu = swan.route(swan.describe_call((), kw, "flashinfer"), CPU_TWIN_CAPS)
        by_key.setdefault(key, []).append((name, (decide(kw), on_cpu)))
    for group in by_key.values():
        assert len({verdict for _, verdict in group}) == 1, group
    twins = [k for k, group in by_key.items() if any(n.startswith("twin") for n, _ in group)]
    assert len(twins) == 1 and len(by_key[twins[0]]) >= 3
    verdicts = {decide(kw) for _, kw in _variants()}
    assert len(by_key) >= len(verdicts) - 1           # - the rows > 64 case, never keyed


def test_entry_reason_is_route_first_checks():
    assert swan.entry_reason(True, "flashinfer", True, 4) == decide(engine_call(), args=(1,))
    assert swan.entry_reason(False, "triton", True, 4) == decide(engine_call(), backend="triton")
    assert swan.entry_reason(False, "flashinfer", True, 65) == decide(engine_call(rows=65))
    assert swan.entry_reason(False, "flashinfer", False, 4) == "q or k_cache missing"
    assert swan.entry_reason(False, "flashinfer", True, 0) == "empty call"
    assert swan.entry_reason(False, "flashinfer", True, 64) is None


def test_router_describes_a_decode_shape_once(install_adapters, fake_module, monkeypatch):
    """Through the installed router: the first call of a decode key is described and routed,
    later calls of that key are not; prefill calls are never keyed; the verdict is the same
    (here: served by the CPU twin, the router's kernel in a process without CUDA)."""
    from adapter import receipts
    from sglang.kernels.ops.attention import flash_mla_sm120 as m

    # routing's decision cache alone (the first-use self-check adds one stock call per key:
    # tests/test_swan_selfcheck.py)
    state = install_adapters({"DSV41_SWA_NATIVE_DECODE": "1", "DSV41_SWAN_SELFCHECK": "0"})["swan"]
    assert state.status == "installed", state.detail
    router = swan.ROUTER
    described = []
    real_describe = swan.describe_call

    def counting(*a, **k):
        described.append(1)
        return real_describe(*a, **k)

    monkeypatch.setattr(swan, "describe_call", counting)
    stock = []
    monkeypatch.setattr(m, "_flash_mla_flashinfer", lambda *a, **k: stock.append(1) or (None, None))
    monkeypatch.setattr(m, "_flash_mla_sm120_prefill", lambda *a, **k: stock.append(1) or (None, None))
    receipts.counters["swan"].clear()
    for _ in range(5):
        m.flash_mla_with_kvcache_sm120(**_real_call(rows=2))
    m.flash_mla_with_kvcache_sm120(**_real_call(rows=3))
    for rows in (65, 66, 67):
        m.flash_mla_with_kvcache_sm120(**_real_call(rows=rows))
    assert len(described) == 2 and router.decisions() == 2
    assert isinstance(router.kernel, swan.Twin) and len(stock) == 3      # prefill rows: stock
    assert receipts.counters["swan"]["served"] == 6
    assert receipts.counters["swan"]["fallback:more than 64 query rows (engine prefill path)"] == 3


# --- the native key (runtime/swan256/router_key.cpp): what the served path reads --------------

@pytest.fixture(scope="module")
def native():
    """The built module's router key extension (decode_key, lookup)."""
    from swan_module_dir import built_router_key

    built_router_key()
    info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
    return swan.load_router_key(info)


@pytest.fixture(scope="module")
def native_key(native):
    return native.decode_key


def test_one_native_key_means_one_python_key(native_key):
    """The native key is exact and at least as fine as decode_key: calls with one native key have
    one Python key (so one route() verdict: test_equal_decode_keys_mean_equal_verdicts), layout-only
    twins share it, and it declines exactly the calls entry_reason() stops (rows > 64)."""
    by_native = {}
    for name, kw in _variants():
        shape = kw["q"].shape
        key = native_key(kw)
        if swan.entry_reason(False, "flashinfer", True, shape[0] if shape else 0) is not None:
            assert key is None, name
            continue
        assert isinstance(key, bytes), name
        by_native.setdefault(key, []).append((name, swan.decode_key(shape, kw)))
    for group in by_native.values():
        assert len({python_key for _, python_key in group}) == 1, [n for n, _ in group]
    twins = [g for g in by_native.values() if any(n.startswith("twin") for n, _ in g)]
    assert len(twins) == 1 and len(twins[0]) >= 3
    assert len(by_native) >= len({k for g in by_native.values() for _, k in g})


def _strided_like(t):
    """Same values and shape, another stride (a transposed copy viewed back)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1)


@pytest.mark.parametrize("change", [
    "head_dim_v", "q rows", "q heads", "q dtype", "q misaligned", "k_cache stride", "k_cache dtype",
    "indices width", "indices dtype", "topk_length dtype", "attn_sink dtype", "attn_sink strided",
    "extra_k_cache pages", "extra_k_cache misaligned", "extra_indices width", "no extra",
    "extra_topk_length missing",
])
def test_native_key_changes_with_every_fact_routing_reads(native_key, change):
    """Negative controls: a key that left out one of these would serve a call on another call's
    decision; each one-fact change gives another key (and the Python key agrees it is another)."""
    base = engine_call()
    kw = dict(base)
    if change == "head_dim_v":
        kw["head_dim_v"] = 256
    elif change == "q rows":
        kw = engine_call(rows=5)
    elif change == "q heads":
        kw = engine_call(heads=32)
    elif change == "q dtype":
        kw["q"] = base["q"].to(torch.float16)
    elif change == "q misaligned":
        kw["q"] = _misaligned_q()
    elif change == "k_cache stride":
        raw = torch.zeros(POOL_PAGES * (swan.PAGE_STRIDE + 16), dtype=torch.uint8)
        kw["k_cache"] = raw.as_strided((POOL_PAGES, 256, 1, swan.ROW_BYTES),
                                       (swan.PAGE_STRIDE + 16, swan.ROW_BYTES, swan.ROW_BYTES, 1))
    elif change == "k_cache dtype":
        kw["k_cache"] = base["k_cache"].view(torch.uint8)
    elif change == "indices width":
        kw["indices"] = torch.full((4, 1, 192), -1, dtype=torch.int32)
    elif change == "indices dtype":
        kw["indices"] = base["indices"].to(torch.int64)
    elif change == "topk_length dtype":
        kw["topk_length"] = base["topk_length"].to(torch.int64)
    elif change == "attn_sink dtype":
        kw["attn_sink"] = base["attn_sink"].to(torch.bfloat16)
    elif change == "attn_sink strided":
        kw["attn_sink"] = torch.zeros(32, dtype=torch.float32)[::2]
    elif change == "extra_k_cache pages":
        kw["extra_k_cache"] = _pool(pages=4, page_tokens=64)[1]
    elif change == "extra_k_cache misaligned":
        raw = torch.zeros(3 * swan.SPLIT_PAGE_STRIDE + 8, dtype=torch.uint8)
        kw["extra_k_cache"] = raw[8:].as_strided((3, 64, 1, swan.ROW_BYTES),
                                                 (swan.SPLIT_PAGE_STRIDE, swan.ROW_BYTES, swan.ROW_BYTES, 1))
    elif change == "extra_indices width":
        kw["extra_indices_in_kvcache"] = torch.full((4, 1, 576), -1, dtype=torch.int32)
    elif change == "no extra":
        kw = engine_call(extra=False)
    elif change == "extra_topk_length missing":
        kw["extra_topk_length"] = None
    assert native_key(kw) is not None and native_key(kw) != native_key(base)
    assert swan.decode_key(kw["q"].shape, kw) != swan.decode_key(base["q"].shape, base)


@pytest.mark.parametrize("case", ["rows 0", "rows 65", "no q", "no k_cache", "q not a tensor",
                                  "head_dim_v float", "head_dim_v missing", "sparse indices",
                                  "q 0-d"])
def test_native_key_declines_what_the_python_path_decides(native_key, case):
    """None sends the call to the router's Python path (entry_reason, decode_key): every call
    the native key cannot describe exactly, including a tensor torch throws on (no C++ exception
    reaches the interpreter)."""
    kw = engine_call()
    if case == "rows 0":
        kw = engine_call(rows=0)
    elif case == "rows 65":
        kw = engine_call(rows=65)
    elif case == "no q":
        del kw["q"]
    elif case == "no k_cache":
        kw["k_cache"] = None
    elif case == "q not a tensor":
        kw["q"] = [[0.0]]
    elif case == "head_dim_v float":
        kw["head_dim_v"] = 512.0
    elif case == "head_dim_v missing":
        del kw["head_dim_v"]
    elif case == "sparse indices":
        kw["indices"] = kw["indices"].to_sparse()
    elif case == "q 0-d":
        kw["q"] = torch.tensor(1.0)
    assert native_key(kw) is None
    with pytest.raises(TypeError):
        native_key([("q", 1)])


def test_native_lookup_finds_only_the_exact_key(native):
    """lookup(kwargs, table): a miss gives (slot, key) with key == decode_key(kwargs); stored
    under that slot, the same call and a layout twin find the decision; another call whose
    slot holds a different key (a planted collision) misses instead of taking that decision."""
    kw, table, decision = engine_call(), {}, object()
    miss = native.lookup(kw, table)
    assert type(miss) is tuple and miss[1] == native.decode_key(kw)
    table[miss[0]] = (miss[1], decision)
    assert native.lookup(kw, table) is decision
    assert native.lookup(engine_call(), table) is decision          # new tensors, same layout
    other = engine_call(rows=5)
    slot, key = native.lookup(other, table)
    assert key != miss[1]
    table[slot] = (miss[1], decision)                               # planted: a wrong key there
    assert native.lookup(other, table) == (slot, key)
    assert native.lookup(engine_call(rows=65), table) is None
    with pytest.raises(TypeError):
        native.lookup(kw, [])
