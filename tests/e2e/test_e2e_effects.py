"""What each adapter does in a real server, measured from the client (HTTP API only)."""
import pytest

from adapter.tools import traffic


def test_decode_yield_stream_cadence_stock_lt_33_lt_50(boots, record_property):
    """Running streams' token rate during a 24,576-token prefill in 4,096-token chunks, over
    their rate before it. Stock runs one decode step between chunks (--prefill-decode-interval 1);
    share 33 / 50 plan more. The achieved share is far below the configured one here: the cost
    model's constants are the cluster's (a CPU chunk is cheap next to its modelled cost)."""
    stock = boots.config("dense", "stock").cadence
    y33 = boots.config("dense", "decode_yield").cadence
    y50 = boots.config("dense", "yield50").cadence
    for c in (stock, y33, y50):
        assert c["long_prompt_completed"], c
        assert c["rate_before_tok_s"] > 0, c
    record_property("cadence", {"stock": stock, "share33": y33, "share50": y50})
    print(f"\ncadence stock {stock['cadence']} share33 {y33['cadence']} share50 {y50['cadence']} "
          f"(prefill {stock['prefill_s']}s / {y33['prefill_s']}s / {y50['prefill_s']}s)")
    assert stock["cadence"] < y33["cadence"] < y50["cadence"], (stock, y33, y50)
    run = boots.config("dense", "decode_yield")
    assert any("chunks yielded" in ln for ln in run.dsv41_lines("decode_yield", "sglang::scheduler"))


def test_swa_thin_keeps_an_idle_sessions_resume_point(boots):
    """Hybrid SWA, small SWA pool: an idle session, four sub-agents x four growing turns, a new
    900-token prompt, then the idle session's next turn. Stock LRU evicts the idle
    session's window first (it is the oldest) and the resume re-prefills; thin moved the agents'
    passed checkpoints to the evict-first end, so the session resumes from cache."""
    stock = boots.config("swa", "stock").idle
    thin = boots.config("swa", "swa_thin").idle
    print(f"\nidle resume cached tokens: stock {stock['resume'].cached_tokens}, thin "
          f"{thin['resume'].cached_tokens} of {stock['session_tokens']}")
    assert stock["resume"].cached_tokens == 0
    assert thin["resume"].cached_tokens == thin["session_tokens"]
    # The agents' own latest turns stay resumable either way.
    assert min(thin["agent_resume_cached"]) > 0 and min(stock["agent_resume_cached"]) > 0
    cmp = traffic.compare([stock["session"], stock["resume"]], [thin["session"], thin["resume"]])
    assert cmp.ok, cmp


@pytest.mark.parametrize("config", ["swa_cone", "production"])
def test_cone_on_the_swa_model_declines_and_changes_no_output(boots, config):
    """Issue 16: a lost sliding window with the full KV resident, on torch_native (not DSV4).
    Cone must not plan (its forward side does not run here): fallback line, stock outputs."""
    stock = boots.config("swa", "stock").window
    run = boots.config("swa", config)
    cone = run.window
    assert stock["resume"].cached_tokens == 0          # the scenario does lose the resume point
    assert cone["resume"].cached_tokens == stock["resume"].cached_tokens
    lines = run.dsv41_lines("swa_cone", "sglang::scheduler")
    assert not [ln for ln in lines if " plan " in ln], lines
    fallback = [ln for ln in lines if " fallback: " in ln]
    assert len(fallback) == 1 and "backend 'torch_native', not DeepseekV4AttnBackend" in fallback[0]
    cmp = traffic.compare([stock["doc"], stock["resume"]], [cone["doc"], cone["resume"]])
    assert cmp.ok and cmp.max_logprob_diff < 1e-4, cmp
