"""`dsv41 sim yield --alternatives` and `dsv41 sim thin --alternatives` (issue 43): the engine's
own knobs beside decode yield and thin, on the sims' real scheduler / real cache, scaled down.

Behaviour only, no timings: which knob gives the streams what, that each row's engine setting is
the one in effect (the interval the real scheduler keeps, the mixed rows in the extend passes, the
adapter installed only on its row), and what each pool does to the two resumes.
"""
from __future__ import annotations

import json
import types

import pytest

from adapter import decode_yield as dy
from adapter.tools.sims import decode_yield as ysim
from adapter.tools.sims import swa_thin as tsim

CHUNK = 8192
PAGE = 256


# --- decode yield side ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def yield_rows():
    # 12K-token streams, a 4-chunk prompt: every row at the cluster cost model
    out = ysim.run_alternatives(share=33, stream_ctx=12_000, prompt=4 * CHUNK)
    return out, {r["name"]: r for r in out["alternatives"]}


def test_every_alternative_has_a_row_with_its_fields(yield_rows):
    out, rows = yield_rows
    assert list(rows) == ["engine PDI 0", "stock PDI 1", "PDI 8", "PDI 16", "mixed chunk",
                          "half chunk", "yield 33"]
    for r in rows.values():
        for field in ("change", "cadence", "rate_during_tok_s", "rate_before_tok_s", "ttft_s",
                      "ttft_vs_stock", "chunks", "decode_steps_between_chunks",
                      "stream_tokens_in_extend_passes", "prefill_decode_interval", "clock"):
            assert field in r, (r["name"], field)
    assert rows["stock PDI 1"]["ttft_vs_stock"] == 1.0
    assert rows["yield 33"]["change"] == "DSV41_DECODE_YIELD=33"
    assert rows["half chunk"]["change"] == "--chunked-prefill-size 4096"
    assert "mix_with_running" in out["mixed_chunk_pricing"]
    json.dumps(out)                                    # the --json object


def test_the_interval_is_the_engines_own_between_every_two_chunks(yield_rows):
    _, rows = yield_rows
    for name, n in (("stock PDI 1", 1), ("PDI 8", 8), ("PDI 16", 16)):
        gaps = rows[name]["decode_steps_between_chunks"]
        assert gaps["min"] == gaps["max"] == n, name
        assert gaps["total"] == n * (rows[name]["chunks"] - 1), name


def test_engine_default_interval_starves_the_streams(yield_rows):
    """Negative control: interval 0 (the engine's default) runs the chunks back to back."""
    _, rows = yield_rows
    r = rows["engine PDI 0"]
    assert r["cadence"] == 0.0 and r["decode_steps_between_chunks"]["total"] == 0
    assert r["ttft_vs_stock"] < 1.0


def test_more_steps_per_chunk_buy_cadence_with_first_token_time(yield_rows):
    _, rows = yield_rows
    order = ["engine PDI 0", "stock PDI 1", "PDI 8", "PDI 16"]
    cadence = [rows[n]["cadence"] for n in order]
    ttft = [rows[n]["ttft_vs_stock"] for n in order]
    assert cadence == sorted(cadence) and len(set(cadence)) == 4
    assert ttft == sorted(ttft) and len(set(ttft)) == 4
    y = rows["yield 33"]
    assert rows["stock PDI 1"]["cadence"] < y["cadence"]
    gaps = y["decode_steps_between_chunks"]
    assert 1 <= gaps["min"] <= gaps["max"] <= dy.MAX_STEPS
    # the same rate before the prompt on every row (the same streams, the same clock)
    assert len({r["rate_before_tok_s"] for r in rows.values() if r["chunk"] == CHUNK}) == 1


def test_mixed_chunk_rides_the_rows_in_every_chunk(yield_rows):
    _, rows = yield_rows
    m, stock = rows["mixed chunk"], rows["stock PDI 1"]
    assert m["mixed_chunk"] and m["clock"] == "sim-priced mixed pass"
    # the engine's mixed path: the streams' rows in each extend pass, one decode step after it
    assert m["stream_tokens_in_extend_passes"] == m["chunks"]
    assert m["decode_steps_between_chunks"]["min"] == m["decode_steps_between_chunks"]["max"] == 1
    # the adder left room for the rows, so the prompt needs at least as many chunks
    assert m["chunks"] >= stock["chunks"]
    assert m["cadence"] > stock["cadence"] and m["ttft_vs_stock"] > 1.0
    assert stock["stream_tokens_in_extend_passes"] == 0


def test_half_chunk_doubles_the_chunks_and_the_gaps(yield_rows):
    _, rows = yield_rows
    h, stock = rows["half chunk"], rows["stock PDI 1"]
    assert h["chunk"] == CHUNK // 2 and h["chunks"] == 2 * stock["chunks"]
    assert h["decode_steps_between_chunks"]["total"] == h["chunks"] - 1
    assert h["cadence"] > stock["cadence"]


def test_a_mixed_pass_is_priced_with_its_decode_rows():
    rows = [types.SimpleNamespace(seqlen=300_000), types.SimpleNamespace(seqlen=300_002)]
    prefill = types.SimpleNamespace(seqlen=8192)
    mixed = types.SimpleNamespace(reqs=[prefill, *rows], decoding_reqs=rows,
                                  extend_lens=[8192, 1, 1], prefix_lens=[16_384, 299_999, 300_001])
    chunk_only = dy.pass_cost_us([8192], [16_384])
    row_terms = dy.step_cost_us(2, 600_002) - dy.CLUSTER.step_fixed_us
    assert ysim.extend_pass_cost_us(mixed) == chunk_only + row_terms
    # the rows cost more than the cost model's one-token chunks would say ...
    assert ysim.extend_pass_cost_us(mixed) > dy.pass_cost_us(mixed.extend_lens, mixed.prefix_lens)
    # ... and a plain extend is the cost model's pass, unchanged
    plain = types.SimpleNamespace(reqs=[prefill], decoding_reqs=None, extend_lens=[8192],
                                  prefix_lens=[16_384])
    assert ysim.extend_pass_cost_us(plain) == chunk_only


def test_yield_row_alone_installs_the_adapter_and_unset_share_drops_it(monkeypatch, capsys):
    from adapter import installer

    seen = []

    def fake_run(**kw):
        seen.append((kw["interval"], kw["chunk"], kw["mixed_chunk"],
                     installer.status().get(dy.NAME) and installer.status()[dy.NAME].status))
        return {"cadence": 0.5, "ttft_us": 1_000_000, "chunks": 2, "decode_steps": 1,
                "rate_before_tok_s": 1.0, "rate_during_tok_s": 0.5,
                "stream_tokens_in_extend_passes": 0,
                "decode_steps_between_chunks": {"min": 1, "max": 1, "total": 1}}

    monkeypatch.setattr(ysim, "_one_run", fake_run)
    assert ysim.main(["--alternatives", "--json", "--share", "50"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in out["alternatives"]][-1] == "yield 50"
    installed = [s for s in seen if s[3] == "installed"]
    assert installed == [(1, CHUNK, False, "installed")]          # the yield row only
    assert (1, CHUNK // 2, False, None) in seen and (1, CHUNK, True, None) in seen
    seen.clear()
    assert ysim.main(["--alternatives", "--json", "--share", "unset"]) == 0
    names = [r["name"] for r in json.loads(capsys.readouterr().out)["alternatives"]]
    assert names == ["engine PDI 0", "stock PDI 1", "PDI 8", "PDI 16", "mixed chunk", "half chunk"]
    assert len(seen) == 6 and not any(s[3] for s in seen)
    # the text table: one line per row
    assert ysim.main(["--alternatives", "--share", "33"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("  ")[0] for ln in lines[2:9]] == names + ["yield 33"]


# --- cache side ---------------------------------------------------------------------------------

# The scaled-down scenario of tests/test_swa_thin_sim.py: two idle ~37K / ~34K sessions, sub-agents
# and two 60K sessions. Pools stand in for the rows' engine sizing at this scale: the tails rows a
# 64-page SWA pool, the ratio row a larger SWA pool (400 pages) from a smaller full pool.
SMALL = tsim.Scenario(idle_sessions=(40_000, 36_000), first_prompt=24_000, agent_turn=3_000,
                      out_len=256, new_sessions=2, new_session_len=60_000, subagents=10,
                      subagent_turns=2, subagent_system=4_096, subagent_task=3_000,
                      resume_turn=1_000)
SMALL_SWA = 64 * PAGE
POOLS = {"stock 128": (400_000, SMALL_SWA), f"stock ratio {tsim.PUBLIC_RATIO}": (300_000, 400 * PAGE),
         "thin 128": (400_000, SMALL_SWA)}


@pytest.fixture(scope="module")
def cache_rows():
    out = tsim.cache_alternatives(scenario=SMALL, pools=POOLS, chunk_grid=True,
                                  names=set(POOLS))
    return out, {r["name"]: r for r in out["alternatives"]}


def test_cache_rows_carry_the_pool_and_the_resume_outcome(cache_rows):
    out, rows = cache_rows
    assert list(rows) == ["stock 128", f"stock ratio {tsim.PUBLIC_RATIO}", "thin 128"]
    for r in rows.values():
        for field in ("full_tokens", "swa_slots", "contexts_1m", "whole_reprefills", "resumed",
                      "resumed_cached_tokens", "resume_prefill_tokens_per_session",
                      "resume_s_modelled", "thin"):
            assert field in r, (r["name"], field)
        assert len(r["resumed"]) == len(r["resume_s_modelled"]) == 2
    assert rows["thin 128"]["thin"] and not rows["stock 128"]["thin"]
    json.dumps(out)


def test_stock_loses_the_windows_a_larger_swa_pool_or_thin_keeps_them(cache_rows):
    _, rows = cache_rows
    stock, ratio, thin = (rows["stock 128"], rows[f"stock ratio {tsim.PUBLIC_RATIO}"],
                          rows["thin 128"])
    assert stock["resumed"] == ["re-prefill", "re-prefill"] and stock["whole_reprefills"] == 2
    for r in (ratio, thin):
        assert r["resumed"] == ["cache", "cache"] and r["whole_reprefills"] == 0
        # a cached resume costs a small part of a whole re-prefill, on the same clock
        for cached, lost in zip(r["resume_s_modelled"], stock["resume_s_modelled"]):
            assert cached * 5 < lost


def test_a_larger_swa_pool_cannot_keep_what_the_full_pool_evicted():
    """Negative control: the ratio row's large SWA pool, but a full pool that cannot hold the
    sessions beside the other traffic: their full KV is gone, so they are re-prefilled anyway."""
    name = f"stock ratio {tsim.PUBLIC_RATIO}"
    out = tsim.cache_alternatives(scenario=SMALL, pools={name: (160_000, 400 * PAGE)},
                                  names={name})
    (r,) = out["alternatives"]
    assert r["resumed"] == ["re-prefill", "re-prefill"]


def test_ratio_pool_is_the_engines_ratio_sizing():
    """0.22 at the cluster's calibrated budget: SWA slots are 0.22 x the full pool (ratio mode,
    the tails size nothing), fewer full tokens than either tails row."""
    pool = tsim.ratio_pool(tsim.PUBLIC_RATIO)
    assert pool["swa_slots"] == int(pool["full_tokens"] * tsim.PUBLIC_RATIO) // PAGE * PAGE
    assert pool["full_tokens"] % PAGE == 0
    assert pool["full_tokens"] < tsim.pool_full_tokens(384) < tsim.pool_full_tokens(128)
    assert pool["swa_slots"] > tsim.swa_slots(384)
    assert pool["tails_equivalent"] > 384
    # a larger ratio: more SWA, less full pool (the same budget)
    more = tsim.ratio_pool(0.3)
    assert more["swa_slots"] > pool["swa_slots"] and more["full_tokens"] < pool["full_tokens"]


def test_thin_cli_alternatives_keeps_the_other_shapes(monkeypatch, capsys):
    seen = {}

    def fake(**kw):
        seen.update(kw)
        return {"alternatives": [], "chunks": "grid", "resume_clock": "x",
                "bytes_per_swa_over_full": 1.0}

    monkeypatch.setattr(tsim, "cache_alternatives", fake)
    assert tsim.main(["--alternatives", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alternatives"] == []
    assert seen["chunk_grid"] is True
    assert tsim.main(["--alternatives", "--chunks", "engine"]) == 0
    assert seen["chunk_grid"] is False and "cache alternatives" in capsys.readouterr().out
    # --pool without --alternatives is the old table
    assert tsim.main(["--pool", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"bytes_per_swa_over_full", "launch", "rows"}


def test_thin_pool_text_is_a_table_not_a_python_dict(capsys):
    """Issue 51: `sim thin --pool` printed its launch values as a Python dict."""
    assert tsim.main(["--pool"]) == 0
    out = capsys.readouterr().out
    assert "{" not in out and "': " not in out
    assert "--max-running-requests 35" in out and "--disable-overlap-schedule" in out
    lines = out.splitlines()
    assert lines[1].split() == ["tails", "SWA", "slots", "cluster", "full", "tokens", "cluster", "1M", "contexts"]
    rows = {ln.split()[0]: ln for ln in lines[2:]}
    assert rows["384"].split()[:4] == ["384", "182,784", "182,784", "3,444,224"]
    assert all(len(ln) == len(lines[1]) for ln in lines[2:])       # right-aligned columns
