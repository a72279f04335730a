"""`dsv41 sim thin --cone` on a scaled-down scenario (real UnifiedRadixCache, real PrefillAdder,
cone replay and thin installed through the production installer): the JSON fields, and what each
variant does to the two resumes."""
from __future__ import annotations

import json

import pytest

from adapter.tools.sims import swa_thin as sim

PAGE = 256
N = 8192
# Two idle sessions of ~37K / ~34K tokens, sub-agents and two 60K sessions, on a 64-page SWA pool:
# the stock LRU loses both resume points, full KV stays resident.
SMALL = sim.Scenario(idle_sessions=(40_000, 36_000), first_prompt=24_000, agent_turn=3_000,
                     out_len=256, new_sessions=2, new_session_len=60_000, subagents=10,
                     subagent_turns=2, subagent_system=4_096, subagent_task=3_000, resume_turn=1_000)
POOL = dict(full_tokens=400_000, swa_tokens=64 * PAGE)


@pytest.fixture(scope="module")
def out():
    results = sim.report(384, sim.cone_variants(N), scenario=SMALL, **POOL)
    return json.loads(json.dumps(sim.as_json(384, results, "engine"))), results


def test_json_keeps_the_issue_fields_and_adds_the_cone_ones(out):
    data, _ = out
    assert data["tails"] == 384 and data["full_tokens"] == 400_000 and data["swa_slots"] == 64 * PAGE
    assert set(data) >= {"control", "thin", "cone", "thin_cone"}
    for name in ("control", "thin", "cone", "thin_cone"):
        v = data[name]
        assert isinstance(v["whole_reprefills"], int)
        assert len(v["resumed_cached_tokens"]) == 2
        for field in ("replays", "replay_tokens", "resume_prefill_tokens", "resumed_prefix_tokens",
                      "resume_prefill_tokens_per_session", "replays_whole_run", "cone_fallbacks"):
            assert field in v, (name, field)
        assert not any(k.startswith("_") for k in v)
        assert v["resume_prefill_tokens"] == sum(v["resume_prefill_tokens_per_session"])


def test_adapters_installed_per_variant(out):
    _, results = out
    assert results["control"]["_adapters"] == {}
    assert results["thin"]["_adapters"] == {"swa_thin": "installed"}
    assert results["cone"]["_adapters"] == {"swa_cone": "installed"}
    assert results["thin_cone"]["_adapters"] == {"swa_thin": "installed", "swa_cone": "installed"}


def test_control_re_prefills_both_sessions(out):
    data, results = out
    c = data["control"]
    assert c["whole_reprefills"] == 2 and c["replays"] == 0
    lens = results["control"]["_idle_lens"]
    # The whole context plus the new turn, every token prefilled again.
    assert c["resume_prefill_tokens_per_session"] == [L + SMALL.resume_turn for L in lens]


def test_cone_replays_one_chunk_per_resume(out):
    data, results = out
    c = data["cone"]
    assert c["whole_reprefills"] == 0 and c["replays"] == 2 and c["replay_tokens"] == 2 * N
    assert c["resumed_cached_tokens"] == data["control"]["resumed_cached_tokens"]   # stock miss
    for prefix, spent, L in zip(c["resumed_prefix_tokens"], c["resume_prefill_tokens_per_session"],
                                results["cone"]["_idle_lens"]):
        assert prefix % PAGE == 0 and prefix >= L - N - 2 * PAGE
        assert N <= spent <= N + SMALL.resume_turn + 2 * PAGE
    assert c["resume_prefill_tokens"] < data["control"]["resume_prefill_tokens"] // 3


def test_thin_keeps_the_resume_points_and_cone_has_nothing_to_replay(out):
    data, results = out
    lens = results["thin"]["_idle_lens"]
    for name in ("thin", "thin_cone"):
        v = data[name]
        assert v["whole_reprefills"] == 0 and v["replays"] == 0
        assert v["resumed_cached_tokens"] == [L // PAGE * PAGE for L in lens]
        assert v["resume_prefill_tokens"] < 2 * (SMALL.resume_turn + 2 * PAGE)


def test_cli_parses_cone(monkeypatch, capsys):
    seen = {}
    real_report = sim.report

    def fake_report(tails, variants, **kw):
        seen.update(tails=tails, variants=list(variants), chunk_grid=kw["chunk_grid"])
        return real_report(tails, variants, scenario=SMALL, **POOL)

    monkeypatch.setattr(sim, "report", fake_report)
    assert sim.main(["--tails", "128", "--cone", "--json"]) == 0
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert seen == {"tails": 128, "variants": ["control", "thin", "cone", "thin_cone"],
                    "chunk_grid": False}
    assert data["tails"] == 128 and data["chunks"] == "engine" and data["cone"]["replays"] == 2
