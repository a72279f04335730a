"""The canary's decode yield line: `decode_yield <model>: achieved share X (configured Y)`, the
achieved share first, read from the per-prompt lines the line's scheduler logged (the engine's
own step timings, adapter/decode_yield.py achieved_share)."""
from adapter.tools import canary

LINE = ("[2026-12-06 15:20:01] [dsv41] decode_yield rid=ab left chunked prefill: 5 chunks yielded, "
        "560 decode steps planned, 560 run, 0 ended early; achieved share {:.2f} (configured 0.33) "
        "by the engine's step timings: decode {:.3f} s over 560 steps, prefill {:.3f} s")
UNMEASURED = ("[2026-12-06 15:20:01] [dsv41] decode_yield rid=cd left chunked prefill: 1 chunks "
              "yielded, 1 decode steps planned, 1 run, 0 ended early; achieved share not measured "
              "(the engine has timed no decode step yet (none followed another))")


def _run(lines, share="33", role="sglang::scheduler pid 12"):
    run = canary.ConfigRun("dense", {"DSV41_DECODE_YIELD": share}, {})
    run.logs = {role: "\n".join(lines), "launcher (HTTP + tokenizer manager) pid 11": LINE.format(0.9, 9.0, 1.0)}
    return run


def test_line_weighs_the_yielded_prompts_by_time_achieved_first():
    """A short window (0.35 of 1 s) and a long one (0.21 of 25 s): the boot's share is the time
    the streams got over all windows, 5.6 of 26 s."""
    eff = canary.yield_shares(_run([LINE.format(0.35, 0.35, 0.65), LINE.format(0.21, 5.25, 19.75)]))
    assert eff["achieved_share_engine_per_prompt"] == [0.35, 0.21]
    assert abs(eff["achieved_share_engine"] - 5.6 / 26) < 1e-4
    assert eff["configured_share"] == 0.33
    assert canary.yield_line("dense", eff) == "decode_yield dense: achieved share 0.22 (configured 0.33)"


def test_line_says_why_a_share_was_not_measured():
    eff = canary.yield_shares(_run([UNMEASURED]))
    assert eff["achieved_share_engine"] is None
    line = canary.yield_line("dsv4", eff)
    assert line.startswith("decode_yield dsv4: achieved share not measured (the engine has timed "
                           "no decode step yet (none followed another))")
    assert line.endswith("(configured 0.33)")


def test_no_line_without_the_key():
    assert canary.yield_line("dense", canary.yield_shares(_run([], share=None))) is None


def test_first_rank_only_under_tp():
    run = _run([LINE.format(0.30, 3.0, 7.0)], role="sglang::scheduler_TP0 pid 12")
    run.logs["sglang::scheduler_TP1 pid 13"] = LINE.format(0.50, 5.0, 5.0)
    assert canary.yield_shares(run)["achieved_share_engine_per_prompt"] == [0.30]


def test_capped_chunks_and_online_scales_are_reported():
    """A prompt whose plans the 128-step cap cut on 3 of its 5 chunks, with online scales: the
    line keeps its form (achieved first) and says how many chunks were capped; the scales and the
    unmeasured reason are read without the line's tail."""
    capped = (LINE.format(0.20, 1.2, 4.8) + "; 3 of 5 chunks capped at 128 steps; online scales at "
              "its last arming: chunk x4.58, decode step x0.0415; 5 plans redone from the chunk's measured "
              "time (agreed over the TP group)")
    tail = ("; online scales at its last arming: chunk x16, decode step x0.483; 0 plans redone from "
            "the chunk's measured time (agreed over the TP group)")
    eff = canary.yield_shares(_run([capped, UNMEASURED + tail]))
    assert eff["chunks_capped"] == 3 and eff["chunks_yielded_measured"] == 5
    assert eff["online_scales"] == [[4.58, 0.0415]]
    assert eff["not_measured"] == ["(the engine has timed no decode step yet (none followed another))"]
    assert canary.yield_line("dense", eff) == (
        "decode_yield dense: achieved share 0.20 (configured 0.33); 3 of 5 chunks capped at 128 "
        "decode steps (worth more: the share falls short there by design)")
    plain = canary.yield_shares(_run([LINE.format(0.30, 3.0, 7.0)]))
    assert plain["chunks_capped"] == 0 and plain["online_scales"] == []
    assert canary.yield_line("dense", plain) == "decode_yield dense: achieved share 0.30 (configured 0.33)"
