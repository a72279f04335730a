"""Cone replay inside the engine's DeepSeek-V4 attention backend (issue 22), on CPU.

The engine's DeepseekV4AttnBackend (GB10 / SM120 dispatch, torch sparse attention, torch indexer
and top-k), its DeepSeekV4TokenToKVPool and ForwardBatch, layers of compress ratio 0, 4 and 128,
page 256, window 128; cone installed by the production installer. H is a prefix hit at F, R is
cone's replay from s = F - N; rows >= F (and what they read) must equal, and every negative
control must be detected. Harness: adapter/cpu/cone_forward/ (bench/cone_forward.py runs the
full case list).

H and R compute rows >= F in passes of other shapes (R's first pass holds [s, L), H's [F, L)),
and R recomputes the SWA window [F - 128, F) that H has from the document's own prefill: float32
sums of different shapes, which another machine's BLAS may order differently. So those are
compared within TOL (below; on this machine they are bit-equal, which the test prints). What cone
copies (the resident latents and index keys of [s, F)) is a byte copy in R and the same bytes in
H: compared bit for bit. A negative control is detected when it moves the compared values by
more than TOL.
"""
import pytest
import torch

from adapter.cpu import cone_forward as cf

DOC = 768
# Rows >= F and the decode steps after them: attention outputs in bf16, from float32 sums over a
# window of <= 128 rows and <= 64 compressed candidates per layer. A sum in another order moves a
# float32 result by ~1e-6 of its terms, which the bf16 cast turns into the same value or the
# adjacent one; adjacent bf16 values differ by at most 2**-7 of the value. TOL is that step at the
# largest |output| (2**-7 of it). Measured on this machine (printed by the tests): H and R are
# bit-equal (0), and the closest negative control, N inside the stack's cone, moves the outputs
# by 4x TOL (0.156 against 0.035, largest |output| 4.5); the others by 7x to 1e5x.
TOL_REL = 2 ** -7
# The bench's control case nearer the start (a shorter document to prefill), with a 48-token
# fresh prompt ahead of it in the first pass (its rows are compared too).
CASE = cf.Case("N=chunk=512 L-F=1 beside a prompt", s=256, F=768, L=769, chunk=512, neighbor=48)
CONE_CASE = cf.Case("N=256 inside the stack's cone", s=512, F=768, L=769, chunk=256)


@pytest.fixture(scope="module")
def harness():
    torch.set_num_threads(1)
    h = cf.Harness(doc=DOC)
    yield h
    h.close()


@pytest.fixture(scope="module")
def replay(harness):
    """The control case: H, and R with cone's forward side as production runs it."""
    return {"H": harness.run_h(CASE), "R": harness.run_r(CASE)}


def test_cone_acts_inside_the_engines_dsv4_backend(harness):
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    assert harness.backend_class is DeepseekV4AttnBackend      # what `dsv4` builds off HIP / NPU
    assert harness.served_by is None                            # cone's match side would plan
    assert harness.hooks_installed()


def _tolerance(run) -> float:
    """TOL: TOL_REL of the largest |output| of H's compared rows and decode steps."""
    outs = [t for p in list(range(CASE.F, CASE.L)) + [-1 - p for p in range(CASE.neighbor)]
            for t in run.extend[p]] + [t for p in run.decode for t in run.decode[p]]
    return TOL_REL * max(float(t.float().abs().max()) for t in outs if t.numel())


@pytest.fixture(scope="module")
def tol(replay):
    return _tolerance(replay["H"])


def test_replay_rows_from_f_equal_a_prefix_hit(harness, replay, tol):
    """Rows >= F, the neighbour's rows and four decode steps after (which read the SWA window,
    latents and index keys): within TOL; the copied latents / index keys of [s, F): bit for bit;
    and no row of the replay read an evicted SWA slot."""
    cmp = harness.compare(CASE, replay["H"], replay["R"])
    assert cmp.rows_compared == CASE.L - CASE.F + CASE.neighbor
    assert cmp.decode_steps == cf.DECODE_STEPS
    assert cmp.worst <= tol, (tol, cmp.max_abs_diff, cmp.decode_max_abs_diff, cmp.differing_views)
    copied = 0
    for (kind, layer), (pos, h_bytes) in replay["H"].view.items():
        if kind == "swa":
            continue                      # recomputed by the replay: read by the rows above
        r_pos, r_bytes = replay["R"].view[(kind, layer)]
        assert torch.equal(pos, r_pos)
        below_f = pos < CASE.F
        copied += int(below_f.sum())
        assert torch.equal(h_bytes[below_f], r_bytes[below_f]), (kind, layer)
    assert copied > 0
    assert replay["R"].evicted_reads == 0
    print(f"\nrows >= F: max |H - R| {cmp.worst:.3g} (TOL {tol:.3g}); bit-equal: {cmp.bit_equal}")


def test_no_copy_is_detected(harness, replay, tol):
    ctl = cf.run_control(harness, "no copy", replay, tol, case=CASE)
    assert ctl["detected"], ctl
    print(f"\n{ctl['name']}: max |diff| {ctl['max_abs_diff']:.3g} > TOL {tol:.3g}")
    assert any(v.startswith("latent layer 1") for v in ctl["views"]), ctl["views"]


def test_no_write_mask_is_detected_and_names_the_overwritten_rows(harness, replay, tol):
    ctl = cf.run_control(harness, "no write mask", replay, tol, case=CASE)
    assert ctl["detected"], ctl
    print(f"\n{ctl['name']}: max |diff| {ctl['max_abs_diff']:.3g} > TOL {tol:.3g}")
    # The replay rows' own latents / index keys landed on the copied ones of [s, F).
    assert f"index_k layer 1 (c4) of resident rows [{CASE.s}," in ctl["overwrote"], ctl
    assert f"latent layer 2 (c128) of resident rows [{CASE.s}," in ctl["overwrote"], ctl


def test_no_window_floor_is_detected_as_reads_of_evicted_slots(harness, replay, tol):
    ctl = cf.run_control(harness, "no window floor", replay, tol, case=CASE)
    assert ctl["detected"], ctl
    print(f"\n{ctl['name']}: max |diff| {ctl['max_abs_diff']:.3g} > TOL {tol:.3g}")
    assert ctl["evicted_slot_reads"] > 0
    # The rows whose window reaches below s are the ones that read them.
    assert ctl["rows_reading_evicted"] == f"[{CASE.s},{CASE.s + cf.WINDOW - 1})"


def test_evicted_slots_left_with_old_contents_is_detected(harness, replay, tol):
    if "no floor" not in replay:
        cf.run_control(harness, "no window floor", replay, tol, case=CASE)
    ctl = cf.run_control(harness, "evicted slots left with their old contents", replay, tol,
                         case=CASE)
    assert ctl["detected"], ctl
    print(f"\n{ctl['name']}: max |diff| {ctl['max_abs_diff']:.3g} > TOL {tol:.3g}")


def test_n_inside_the_stacks_cone_is_detected(harness, replay, tol):
    ctl = cf.run_control(harness, "N inside the exact cone", replay, tol, case=CASE,
                         cone_case=CONE_CASE)
    assert ctl["detected"], ctl
    print(f"\n{ctl['name']}: max |diff| {ctl['max_abs_diff']:.3g} > TOL {tol:.3g}")
