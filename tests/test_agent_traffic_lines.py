"""bench/agent_traffic.py --lines (issue 43): the lines beside the engine's own knobs, the pool
sizes read from the engine's log, the knobs table, and the CPU harness's pool-budget switches
(adapter/cpu/pool_budget.py). No server."""
from __future__ import annotations

import importlib.util
import types

import pytest

from adapter.cpu import pool_budget
from adapter.tools import agent_traffic as at
from conftest import REPO_ROOT

STOCK = {"keys": {}, "args": {"--prefill-decode-interval": "1", "--swa-prefix-tails": "128"}}
LINE = {"keys": {"DSV41_SWA_THIN": "1", "DSV41_DECODE_YIELD": "33"},
        "args": {"--prefill-decode-interval": "1", "--swa-prefix-tails": "384"}}


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agent_traffic", REPO_ROOT / "bench" / "agent_traffic.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_knob_line_is_stock_with_exactly_one_change():
    lines = at.knob_lines(list(at.KNOB_LINES), STOCK, LINE, "1024")
    assert lines["stock"]["keys"] == {} and lines["stock"]["args"] == STOCK["args"]
    assert lines["line"]["keys"] == LINE["keys"] and lines["line"]["args"] == LINE["args"]
    expected = {"pdi8": ({}, {"--prefill-decode-interval": "8"}),
                "pdi16": ({}, {"--prefill-decode-interval": "16"}),
                "mixed": ({}, {"--enable-mixed-chunk": ""}),
                "half": ({}, {"--chunked-prefill-size": "512"}),
                "stock384": ({}, {"--swa-prefix-tails": "384"}),
                "swapool": ({}, {"--swa-full-tokens-ratio": at.SWAPOOL_RATIO}),
                "thin128": ({"DSV41_SWA_THIN": "1"}, {}),
                "thin384": ({"DSV41_SWA_THIN": "1"}, {"--swa-prefix-tails": "384"})}
    for name, (keys, args) in expected.items():
        assert lines[name]["keys"] == keys, name
        assert lines[name]["args"] == {**STOCK["args"], **args}, name
        changed = {k for k in lines[name]["args"] if lines[name]["args"][k] != STOCK["args"].get(k)} | set(keys)
        # one engine knob, or one of ours (thin384 is the production line's thin: its key and its tails)
        assert len(changed) == (2 if name == "thin384" else 1), name
    with pytest.raises(ValueError, match="unknown line"):
        at.knob_lines(["stock", "fast"], STOCK, LINE, "1024")


def test_thin384_is_the_production_lines_thin_alone():
    bench = _bench()
    base = bench.lines(REPO_ROOT / ".env.tp4.example", model="dsv4")
    lines = at.knob_lines(["thin384", "stock384"], base["stock"], base["line"], "1024")
    assert lines["thin384"]["keys"]["DSV41_SWA_THIN"] == base["line"]["keys"]["DSV41_SWA_THIN"]
    assert lines["thin384"]["args"]["--swa-prefix-tails"] == base["line"]["args"]["--swa-prefix-tails"]
    assert lines["stock384"]["args"]["--swa-prefix-tails"] == base["line"]["args"]["--swa-prefix-tails"]


def test_pool_sizes_read_the_dsv4_configurators_lines():
    cap = {"s": "[ts] DSV4 SWA sizing: mode=cap, swa_tokens=57600, request_cap+headroom=57600, prefix_tails=128\n"
                "[ts] DSV4 pool sizes: full=3541504, swa=57600, c4=885376, c128=27668, c4_state=1800, c128_state=0\n"}
    assert at.pool_sizes(cap) == {"swa": 57600, "full": 3541504, "mode": "cap", "tails": 128}
    ratio = {"s": "[ts] DSV4 SWA sizing: mode=ratio (explicit), swa_tokens=279040, swa_full_tokens_ratio=0.22\n"
                  "[ts] DSV4 pool sizes: full=1268480, swa=279040, c4=1, c128=1, c4_state=1, c128_state=0\n"}
    assert at.pool_sizes(ratio) == {"swa": 279040, "full": 1268480, "mode": "ratio (explicit)", "ratio": 0.22}
    assert at.pool_sizes({"s": "nothing"}) is None


def test_session_full_tokens_in_pages():
    assert at.session_full_tokens(2300, 256) == 2304
    assert at.session_full_tokens(2304, 256) == 2304
    assert at.session_full_tokens(7, 1) == 7


def test_knobs_scale_leaves_the_pools_to_the_engine():
    sc = at.scale_of("dsv4", "knobs")
    args = sc.server_args()
    assert args["--max-total-tokens"] is None and args["--swa-full-tokens-ratio"] is None
    assert sc.server_env() == {"DSV41CPU_FREE_MEMORY_MB": "2627", "DSV41CPU_DSV4_CAP_SIZING": "1"}
    rows = {r["what"]: r["cpu"] for r in at.scaling_table("dsv4", "knobs")}
    assert "cap mode" in rows["SWA pool"] and "fixed KV budget" in rows["full KV pool"]


def _boot(label, index, itl50, rps, cached, pool, outputs):
    return {"label": label, "index": index, "errors": [], "pool": pool, "outputs_conversations": outputs,
            "rows": {"streams": {"itl_p50_s": itl50, "itl_p99_s": 2 * itl50, "rate_ratio": 0.5, "long_ttft_s": 3.0},
                     "short": {"request_throughput": rps},
                     "resume": {"cached_fraction": cached, "ttft_p50_s": 1.0,
                                "resumed": [{"prompt_tokens": 2300}, {"prompt_tokens": 2250}]}}}


def test_knob_aggregate_and_table():
    bench = _bench()
    p128 = {"full": 3541504, "swa": 57600, "mode": "cap", "tails": 128}
    p384 = {"full": 2442240, "swa": 155904, "mode": "cap", "tails": 384}
    boots = [_boot("stock", 1, 1.0, 2.0, 0.9, p128, {"a": [1]}), _boot("thin384", 2, 0.5, 1.0, 0.9, p384, {"a": [1]}),
             _boot("stock", 3, 3.0, 2.0, 0.9, p128, {"a": [1]}), _boot("thin384", 4, 1.5, 3.0, 0.9, p384, {"a": [2]})]
    agg = bench.knob_aggregate(boots, ["stock", "thin384"], page=256)
    t = agg["thin384"]
    assert t["per_boot"]["itl_p50_s"] == [0.5, 1.5] and t["median"]["itl_p50_s"] == 1.0
    assert t["vs_stock"]["itl_p50_s"] == pytest.approx(0.5)             # 1.0 / 2.0 (medians)
    assert t["vs_stock_per_round"]["itl_p50_s"] == [0.5, 0.5]           # each round against its stock boot
    assert t["apart"]["short_rps"] == pytest.approx(2.0)                # 3.0 / 1.0 - 1
    assert t["session_full_tokens"] == 2304 and t["capacity_sessions"] == [2442240 // 2304] * 2
    assert [o["equal"] for o in t["outputs_vs_stock_boot_1"]] == [1, 0]
    assert [o["equal"] for o in agg["stock"]["outputs_vs_stock_boot_1"]] == [1]     # stock boot 3 only
    # a line boot pairs with the stock boot of its own round, not the n-th stock boot
    three = boots[:2] + [_boot("thin384", 4, 2.0, 3.0, 0.9, p384, {"a": [1]}), _boot("stock", 5, 4.0, 2.0, 0.9, p128, {}),
                         _boot("thin384", 6, 1.0, 3.0, 0.9, p384, {"a": [1]})]
    three[2]["index"] = 4      # round 1 (boots 3-4): its stock boot (3) failed and is absent
    agg3 = bench.knob_aggregate(three, ["stock", "thin384"], page=256)
    assert agg3["thin384"]["vs_stock_per_round"]["itl_p50_s"] == [0.5, None, 0.25]
    spec = at.knob_lines(["stock", "thin384"], STOCK, LINE, "1024")
    table = bench.knob_table(agg, spec)
    assert len(table) == 4 and table[2].startswith("| stock |") and table[3].startswith("| thin384 |")
    assert "2,442,240 / 155,904 (cap, tails 384)" in table[3] and "x0.5" in table[3]


def test_pool_budget_fixes_free_memory_and_drops_only_the_ratio_default(monkeypatch):
    monkeypatch.setenv(pool_budget.FREE_MEMORY_ENV, "2627")
    assert pool_budget.free_memory_bytes() == 2627 << 20
    memory = types.SimpleNamespace(get_free_cpu_memory=lambda: 1)
    pool_budget.apply_free_memory(memory)
    pool_budget.apply_free_memory(memory)          # idempotent
    assert memory.get_free_cpu_memory() == 2627 << 20
    for bad in ("", "0", "-1", "x", "inf"):
        monkeypatch.setenv(pool_budget.FREE_MEMORY_ENV, bad)
        with pytest.raises(ValueError, match=pool_budget.FREE_MEMORY_ENV):
            pool_budget.free_memory_bytes()

    def provider(server_args, hf_config):
        return {"attention_backend": "dsv4", "swa_full_tokens_ratio": 0.1, "page_size": 256}

    registry = {pool_budget.ARCHITECTURE: [provider]}
    monkeypatch.setitem(__import__("sys").modules, pool_budget.OVERRIDE_REGISTRY,
                        types.SimpleNamespace(_MODEL_OVERRIDE_FNS=registry))
    pool_budget.apply_cap_sizing(types.SimpleNamespace(_deepseek_v4_overrides=provider))
    wrapped = registry[pool_budget.ARCHITECTURE][0]
    assert wrapped is not provider
    assert wrapped(None, None) == {"attention_backend": "dsv4", "page_size": 256}
    pool_budget.apply_cap_sizing(types.SimpleNamespace(_deepseek_v4_overrides=provider))   # idempotent
    assert registry[pool_budget.ARCHITECTURE] == [wrapped]
