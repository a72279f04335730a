"""What each adapter does in a real server: from the client (HTTP API) and the receipts."""
import re

from adapter.tools import canary, traffic

# The session's shared runs this module reads (booted by conftest's lane ahead of it).
SHARED_BOOTS = [("dense", "autotune_keep"), ("dense", "decode_yield"), ("dense", "production"),
                ("dsv41", "autotune_keep"), ("dsv41", "production"), ("dsv41", "cone_no_copy"),
                ("dsv41", "cone_no_mask")]

YIELD_LINE = re.compile(r"\[dsv41\] decode_yield rid=\S+ left chunked prefill: (\d+) chunks yielded, "
                        r"(\d+) decode steps planned, (\d+) run, (\d+) ended early")
REDONE = re.compile(r"; (\d+) plans redone from the chunk's measured time")
PREFILL_LINE = re.compile(r"Prefill batch.*#new-token: (?P<new>\d+),.*#pending-token: (?P<pending>\d+)")
CHUNK = 4096                                # dense: --chunked-prefill-size (canary.MODEL_ARGS)
PREFILL = canary.CADENCE_PREFILL["dense"]   # the cadence prompt: 12,288 tokens


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
    """A 12,288-token prefill in 4,096-token chunks beside two streams. What is deterministic here
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


# --- the tiny DeepSeek-V4.1 (adapter/cpu/models.py dsv41): cone, thin, decode yield act ----------
# The model the line serves, with the engine's decoder SWA bounded replay on for control and line
# (its V4.1 default on CUDA; the harness sets it). Scenarios sized for its pools (adapter/tools/
# traffic.py DSV4_* / DSV41_*): page 256, window 128, 1024-token chunks, SWA pool 2048 of 8192.
# The production line runs cone with DSV41_SWA_CONE_TOKENS=512 (canary.SCALED_KEYS: the profile's
# 8192 exceeds every resume point of this pool). Beside the decoder replay a resume's answer
# depends on where its passes start, so cone's resume is held to the control's prefix hit at F
# (traffic.prefix_hit, canary.records_of), not to its cold re-prefill (docs/swa_cone.md).
PLAN = re.compile(r"\[dsv41\] swa_cone plan request=\S+ F=(\d+) s=(\d+) L=(\d+) replay=(\d+) ")


def _plans(run):
    return [tuple(map(int, m.groups())) for ln in run.dsv41_lines("swa_cone", "sglang::scheduler")
            for m in [PLAN.search(ln)] if m]


def _window_records(control, run):
    """The window scenario's records of the control (the references: its prefix hit at F for the
    resume) and of the run, through the canary's own comparison (canary.records_of)."""
    names = (control.window["doc"].name, control.window["resume"].name)
    ref = [r for r in canary.records_of(control, reference_for=run) if r.name in names]
    return ref, [r for r in canary.records_of(run) if r.name in names]


def test_cone_replays_the_lost_window_and_equals_a_hit_at_F(boots):
    """The document's SWA window is evicted while its full KV [0, F) stays. The control re-prefills
    the whole resume; cone plans a replay of [s, F) (s = F - 512) in one pass, copies the resident
    latents / index keys, and answers as the engine answers the same prompt as a prefix hit at F
    with the decoder bounded replay on (ids equal over 10 greedy tokens, logprobs within the
    canary's tolerance); its distance from the cold re-prefill is printed."""
    control, run = boots.config("dsv41", "autotune_keep"), boots.config("dsv41", "production")
    window = run.window
    plans = _plans(run)
    copies = [ln for ln in run.dsv41_lines("swa_cone", "sglang::scheduler") if " copy request=" in ln]
    print(f"\nlost-window resume cached tokens: control {control.window['resume'].cached_tokens}, "
          f"cone {window['resume'].cached_tokens} of {window['prompt_len']}; the control's hit at F "
          f"{control.window['hit'].cached_tokens}; plans {plans}")
    assert control.window["resume"].cached_tokens == 0      # the scenario does lose the resume point
    assert len(plans) == 1 and len(copies) == 1
    F, s, L, replay = plans[0]
    assert replay == traffic.DSV4_CONE_TOKENS and F - s == replay and L == window["prompt_len"]
    assert F == traffic.DSV4_WINDOW_F == control.window["hit"].cached_tokens   # the reference is a hit at F
    assert window["resume"].cached_tokens == s > 0
    assert len(window["resume"].ids) >= 8
    ref, mine = _window_records(control, run)
    # the window's requests run alone (no batch to move their numbers): the strict tolerance
    cmp = traffic.compare(ref, mine)
    cold = traffic.compare([control.window["resume"]], [window["resume"]])
    print(f"cone vs the control's hit at F: {cmp}; vs its cold re-prefill: ids equal "
          f"{control.window['resume'].ids == window['resume'].ids}, max logprob diff "
          f"{cold.max_logprob_diff:.3g}")
    assert cmp.ok, cmp


def test_cone_negative_control_without_the_copy_differs(boots):
    """DSV41_SWA_CONE_TEST_NO_COPY=1 (test-only): the same plan, write mask and floor, no copy:
    the rows >= F that share the first pass read the replay rows' pages with stale latents /
    index keys, and the resume differs from the hit at F. So the equality above can fail, and the
    failure is cone's (its TEST ONLY lines; the document, a plain prefill, stays equal). Removing
    the window floor alone does not change rows >= F at N = 512 (docs/swa_cone.md)."""
    control, run = boots.config("dsv41", "autotune_keep"), boots.config("dsv41", "cone_no_copy")
    lines = run.dsv41_lines("swa_cone", "sglang::scheduler")
    installed = [ln for ln in lines if " installed:" in ln]
    assert installed and "TEST ONLY, NEGATIVE CONTROL: DSV41_SWA_CONE_TEST_NO_COPY=1" in installed[0]
    assert len([ln for ln in lines if "TEST ONLY copy SKIPPED" in ln]) == 1
    assert not [ln for ln in lines if " copy request=" in ln]
    assert _plans(run) == _plans(boots.config("dsv41", "production"))
    ref, mine = _window_records(control, run)
    cmp = traffic.compare(ref, mine)
    print(f"\nno copy vs the control's hit at F: {cmp}")
    assert cmp.mismatches == ["doc+turn"], cmp      # the document itself is a plain prefill


def test_cone_negative_control_without_the_write_mask_differs(boots):
    """DSV41_SWA_CONE_TEST_NO_MASK=1 (test-only): the same plan, copy and floor, no write mask:
    the replay rows write their own latents / index keys (computed from a window floored at s)
    over the copied ones, which rows >= F read in the same pass, and the resume differs from the
    hit at F. So the mask is what keeps the copied bytes."""
    control, run = boots.config("dsv41", "autotune_keep"), boots.config("dsv41", "cone_no_mask")
    lines = run.dsv41_lines("swa_cone", "sglang::scheduler")
    installed = [ln for ln in lines if " installed:" in ln]
    assert installed and "TEST ONLY, NEGATIVE CONTROL: DSV41_SWA_CONE_TEST_NO_MASK=1" in installed[0]
    assert len([ln for ln in lines if "TEST ONLY write mask REMOVED" in ln]) == 1
    assert len([ln for ln in lines if " copy request=" in ln]) == 1
    assert _plans(run) == _plans(boots.config("dsv41", "production"))
    ref, mine = _window_records(control, run)
    cmp = traffic.compare(ref, mine)
    print(f"\nno mask vs the control's hit at F: {cmp}")
    assert cmp.mismatches == ["doc+turn"], cmp


def test_cone_on_a_model_without_deepseek_v4_attention_plans_nothing(boots):
    """The dense production boot carries cone: no DeepSeek-V4 backend, no plan, stock outputs
    (test_e2e_server.test_t0_outputs_equal_stock)."""
    run = boots.config("dense", "production")
    assert not [ln for ln in run.dsv41_lines("swa_cone", "sglang::scheduler") if " plan " in ln]


def test_swa_thin_keeps_an_idle_sessions_resume_point(boots):
    """Stock LRU evicts the idle session's only SWA page first; thin evicts the new prompt's
    passed chunk checkpoints first, so the session resumes from cache (all its tokens)."""
    stock = boots.config("dsv41", "autotune_keep").idle
    thin = boots.config("dsv41", "production").idle
    print(f"\nidle resume cached tokens: stock {stock['resume'].cached_tokens}, thin "
          f"{thin['resume'].cached_tokens} of {thin['session_tokens']}")
    assert stock["resume"].cached_tokens == 0
    assert thin["resume"].cached_tokens == thin["session_tokens"]
    cmp = traffic.compare([stock["session"], stock["resume"]], [thin["session"], thin["resume"]],
                          tol=canary.LOGPROB_TOL["dsv41"])
    assert cmp.ok, cmp


def test_decode_yield_decides_beside_a_chunked_prefill_on_dsv41(boots):
    """One stream decodes (it runs before the prompt arrives: traffic.decode_beside_chunked_prefill)
    while a 2054-token prompt prefills in three passes: the yield arms after each of the two
    non-final chunks (one decision line for the prompt). The cluster cost model alone plans 1 step
    for a 1024-token chunk here (its modelled cost is below one decode step's 67/33 share), the
    stock interval; with DSV41_DECODE_YIELD_ONLINE (the production line) each chunk's plan is at
    least the re-plan point (2 steps) and is redone there from the chunk's measured time, once per
    chunk: that is server state (the decision line's counts), asserted. How many steps the
    measured time is worth is a time ratio of this machine (on an idle one a CPU chunk of the tiny
    DeepSeek-V4.1 is worth many decode steps): printed here, its effect on the share is the canary's
    figure, and the re-plan's arithmetic on given measurements is tests/test_decode_yield.py's
    (test_online_calibration_lands_the_share_where_the_model_is_off)."""
    stock, run = boots.config("dsv41", "autotune_keep"), boots.config("dsv41", "production")
    decisions = [tuple(map(int, m.groups())) for ln in run.dsv41_lines("decode_yield", "sglang::scheduler")
                 for m in [YIELD_LINE.search(ln)] if m]
    print(f"\ndecode_yield decisions (all of the boot's traffic): {decisions}")
    # the beside-scenario's prompt is among them: two chunks yielded, every planned step run, each
    # chunk's plan at least the re-plan point (online: REPLAN_AT[0] = 2 steps) and redone there
    # from the chunk's measured time (a plan of 8 or more steps is redone at its 8th deferral too)
    lines = run.dsv41_lines("decode_yield", "sglang::scheduler")
    redone = {tuple(map(int, m.groups())): int(r.group(1)) for ln in lines
              for m in [YIELD_LINE.search(ln)] for r in [REDONE.search(ln)] if m and r}
    beside = [d for d in decisions if d[0] == 2 and d[3] == 0]
    assert beside and all(planned == ran and planned >= 2 * 2 for _, planned, ran, _ in beside), decisions
    assert all(redone.get(d, 0) >= d[0] for d in beside), (beside, redone)
    assert all(ran + early <= planned for _, planned, ran, early in decisions), decisions
    assert any("DSV41_DECODE_YIELD_ONLINE=1" in ln for ln in lines if " installed:" in ln), lines
    print(f"steps planned per yielded chunk (from this machine's measured chunk / step times): "
          f"{[planned / chunks for chunks, planned, _, _ in beside]}")
    assert not stock.dsv41_lines("decode_yield")
    cmp = traffic.compare([stock.beside["stream"], stock.beside["prompt"]],
                          [run.beside["stream"], run.beside["prompt"]], tol=canary.LOGPROB_TOL["dsv41"])
    assert cmp.ok, cmp
