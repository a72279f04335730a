"""`dsv41 sim all`: plots and report from the sims' JSON fields (the sims themselves have tests)."""
from adapter.tools.sims import all as sim_all

RESULTS = {
    "yield": {33: {"cadence_stock": 0.08, "cadence_yield": 0.349, "first_token_ratio": 1.414},
              50: {"cadence_stock": 0.08, "cadence_yield": 0.51, "first_token_ratio": 1.878}},
    "thin": {384: {"tails": 384, "control": {"whole_reprefills": 2, "resumed_cached_tokens": [0, 0]},
                   "thin": {"whole_reprefills": 0, "resumed_cached_tokens": [329216, 295424]}}},
    "cone": {"stock_prefill_tokens": 302048, "cone_prefill_tokens": 10464,
             "cached_tokens": 291584, "prompt_tokens": 302048},
    "autotune": {"boots": 4, "stock": {"dropped_boots": 3},
                 "keep": {"dropped_boots": 1, "dropped_on": ["launch-arg change"]}},
}


def test_plots_are_pngs_and_report_carries_the_figures(tmp_path):
    files = sim_all.plot(RESULTS, tmp_path)
    assert sorted(f.name for f in files) == ["cone_prefill.png", "thin_resume.png", "yield_cadence.png"]
    for f in files:
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
    text = sim_all.report(RESULTS)
    assert "share 33: cadence 0.080 -> 0.349" in text
    assert "384 tails: whole re-prefills control 2, thin 0" in text
    assert "prefill 302,048 -> 10,464 tokens" in text
    assert "keep 1 (launch-arg change)" in text
