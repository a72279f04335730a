"""What each adapter does in a real server: from the client (HTTP API) and the receipts."""
import re

from adapter.tools import canary, traffic

YIELD_LINE = re.compile(r"\[dsv41\] decode_yield rid=\S+ left chunked prefill: (\d+) chunks yielded, "
                        r"(\d+) decode steps planned, (\d+) run, (\d+) ended early")
PREFILL_LINE = re.compile(r"Prefill batch.*#new-token: (?P<new>\d+),.*#pending-token: (?P<pending>\d+)")
CHUNK = 4096                                # dense: --chunked-prefill-size (canary.MODEL_ARGS)
PREFILL = canary.CADENCE_PREFILL["dense"]   # the cadence prompt: 24,576 tokens


def _yield_receipts(run):
    """(chunks yielded, steps planned, steps run, ended early) per prompt that yielded."""
    return [tuple(map(int, m.groups())) for ln in run.dsv41_lines("decode_yield", "sglang::scheduler")
            for m in [YIELD_LINE.search(ln)] if m]


def _chunks_of_the_long_prompt(run):
    """The cadence prompt's chunks from the scheduler's `Prefill batch` lines: the chain whose
    #pending-token starts at PREFILL - CHUNK and falls by #new-token each chunk."""
    lines = [(int(m.group("new")), int(m.group("pending"))) for ln in run.lines("sglang::scheduler")
             for m in [PREFILL_LINE.search(ln)] if m]
    for i, (new, pending) in enumerate(lines):
        if new == CHUNK and pending == PREFILL - CHUNK:
            chain = [new]
            for new_next, pending_next in lines[i + 1:]:
                if pending_next != pending - new_next:
                    break
                chain.append(new_next)
                pending = pending_next
            return chain
    return []


def test_decode_yield_plans_its_steps_on_the_chunk_boundaries(boots, record_property):
    """A 24,576-token prefill in 4,096-token chunks beside two streams. What is deterministic here
    is asserted: the chunk boundaries (the same as the control's), which chunks yielded, the steps
    planned by the integer cost model (replicated state only: no clock) and that every planned
    step ran. The streams' rate (cadence) is printed, not ordered: on 2 shared cores it swings 2x
    between boots, and time ratios belong to benchmarks (bench/, `dsv41 canary`). A larger share
    planning more steps is shown on the engine's scheduler (tests/test_decode_yield.py
    test_share_50_yields_more_than_33); the real server's planner answering its cost model by
    test_e2e_calibrate (the fitted model plans more steps for the same prompt)."""
    control = boots.config("dense", "autotune_keep")           # the control line: yield off
    y33 = boots.config("dense", "decode_yield")
    for run in (control, y33):
        assert run.cadence["long_prompt_completed"], run.cadence
    record_property("cadence", {"control": control.cadence, "share33": y33.cadence})
    print(f"\ncadence (printed, not compared) control {control.cadence['cadence']} share33 "
          f"{y33.cadence['cadence']}")
    assert not control.dsv41_lines("decode_yield")               # control: not installed, no yield
    r33 = _yield_receipts(y33)
    assert r33, r33
    long33 = max(r33)                                             # the cadence prompt: most chunks
    boundaries = _chunks_of_the_long_prompt(y33)
    assert boundaries == _chunks_of_the_long_prompt(control)
    assert sum(boundaries) == PREFILL and all(c == CHUNK for c in boundaries[:-1]), boundaries
    chunks = len(boundaries)
    assert long33[0] == chunks - 1                                # every non-final chunk yielded
    assert long33[0] <= long33[1] <= 128 * long33[0]              # >= interval 1, <= 128 per chunk
    _, planned, ran, early = long33
    assert ran + early <= planned and ran > 0


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


def test_cone_on_the_swa_model_declines_and_changes_no_output(boots):
    """Issue 16: a lost sliding window with the full KV resident, on torch_native (not DSV4).
    Cone must not plan (its forward side does not run here): fallback line, stock outputs.
    The production line carries cone (no separate cone-alone boot: it declines the same way)."""
    stock = boots.config("swa", "stock").window
    run = boots.config("swa", "production")
    cone = run.window
    assert stock["resume"].cached_tokens == 0          # the scenario does lose the resume point
    assert cone["resume"].cached_tokens == stock["resume"].cached_tokens
    lines = run.dsv41_lines("swa_cone", "sglang::scheduler")
    assert not [ln for ln in lines if " plan " in ln], lines
    fallback = [ln for ln in lines if " fallback: " in ln]
    assert len(fallback) == 1 and "backend 'torch_native', not DeepseekV4AttnBackend" in fallback[0]
    cmp = traffic.compare([stock["doc"], stock["resume"]], [cone["doc"], cone["resume"]])
    assert cmp.ok and cmp.max_logprob_diff < 1e-4, cmp
