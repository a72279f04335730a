"""Cone replay inside the engine's DeepSeek-V4 attention backend (issue 22), on CPU.

The engine's DeepseekV4AttnBackend (GB10 / SM120 dispatch, torch sparse attention, torch indexer
and top-k), its DeepSeekV4TokenToKVPool and ForwardBatch, layers of compress ratio 0, 4 and 128,
page 256, window 128; cone installed by the production installer. H is a prefix hit at F, R is
cone's replay from s = F - N; rows >= F (and what they read) must be bit-equal, and every
negative control must be detected. Harness: adapter/cpu/cone_forward/ (bench/cone_forward.py
runs the full case list).
"""
import pytest
import torch

from adapter.cpu import cone_forward as cf

DOC = 768
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


def test_replay_rows_from_f_are_bit_equal_to_a_prefix_hit(harness, replay):
    """Rows >= F, the neighbour's rows, what they read (SWA window, latents, index keys) and
    four decode steps after: bit for bit; and no row of the replay read an evicted SWA slot."""
    cmp = harness.compare(CASE, replay["H"], replay["R"])
    assert cmp.rows_compared == CASE.L - CASE.F + CASE.neighbor
    assert cmp.decode_steps == cf.DECODE_STEPS
    assert cmp.bit_equal, (cmp.max_abs_diff, cmp.decode_max_abs_diff, cmp.differing_views)
    assert replay["R"].evicted_reads == 0


def test_no_copy_is_detected(harness, replay):
    ctl = cf.run_control(harness, "no copy", replay, 0.0, case=CASE)
    assert ctl["detected"], ctl
    assert any(v.startswith("latent layer 1") for v in ctl["views"]), ctl["views"]


def test_no_write_mask_is_detected_and_names_the_overwritten_rows(harness, replay):
    ctl = cf.run_control(harness, "no write mask", replay, 0.0, case=CASE)
    assert ctl["detected"], ctl
    # The replay rows' own latents / index keys landed on the copied ones of [s, F).
    assert f"index_k layer 1 (c4) of resident rows [{CASE.s}," in ctl["overwrote"], ctl
    assert f"latent layer 2 (c128) of resident rows [{CASE.s}," in ctl["overwrote"], ctl


def test_no_window_floor_is_detected_as_reads_of_evicted_slots(harness, replay):
    ctl = cf.run_control(harness, "no window floor", replay, 0.0, case=CASE)
    assert ctl["detected"], ctl
    assert ctl["evicted_slot_reads"] > 0
    # The rows whose window reaches below s are the ones that read them.
    assert ctl["rows_reading_evicted"] == f"[{CASE.s},{CASE.s + cf.WINDOW - 1})"


def test_evicted_slots_left_with_old_contents_is_detected(harness, replay):
    if "no floor" not in replay:
        cf.run_control(harness, "no window floor", replay, 0.0, case=CASE)
    ctl = cf.run_control(harness, "evicted slots left with their old contents", replay, 0.0,
                         case=CASE)
    assert ctl["detected"], ctl


def test_n_inside_the_stacks_cone_is_detected(harness, replay):
    ctl = cf.run_control(harness, "N inside the exact cone", replay, 0.0, case=CASE,
                         cone_case=CONE_CASE)
    assert ctl["detected"], ctl
