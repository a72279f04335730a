"""The CPU compressor stand-in (adapter/cpu/dsv4/compressor.py) against the rule documented in
the kernels the engine ships (c_plan.cuh, c4_v2.cuh, c128_v2.cuh): there is no torch reference
of compress_forward in the engine (sglang.test.kernels.deepseek_v4.common runs the CUDA kernels),
so the reference here is `reference_groups`, every group computed in one shot from all of a
request's rows. Chunked prefills (and decode steps) run through the state ring, which must carry
partial groups and c4's overlap across chunk boundaries."""
import pytest
import torch

from adapter.cpu.dsv4 import compressor as C

HD = 128
SWA_PAGE = 256
L = 1100           # not a multiple of 4 or 128: a partial group is left in the ring


def _world(ratio, n_reqs=2, max_len=2048):
    # identity req_to_token / full_to_swa per request, as the engine kit's make_paged_context
    req_to_token = torch.arange(n_reqs * max_len, dtype=torch.int32).view(n_reqs, max_len)
    full_to_swa = torch.arange(n_reqs * max_len, dtype=torch.int64)
    ring_size = 8 if ratio == 4 else 128
    coff = 2 if ratio == 4 else 1
    pages = n_reqs * max_len // SWA_PAGE * ring_size // ratio + n_reqs * ring_size
    buf = torch.zeros(pages, ratio, 2 * HD * coff, dtype=torch.float32)
    return dict(req_to_token=req_to_token, full_to_swa=full_to_swa, swa_page_size=SWA_PAGE,
                ring_size=ring_size), buf


def _inputs(ratio, n, seed):
    g = torch.Generator().manual_seed(seed)
    coff = 2 if ratio == 4 else 1
    rows = torch.randn(n, 2 * HD * coff, generator=g)
    ape = torch.randn(C.window(ratio), HD, generator=g) * 0.5
    return rows, ape


def _run(ratio, rows, ape, bounds, *, rid=1, decode_from=None):
    """Prefill over `bounds` chunks, then decode each token from `decode_from` on."""
    slots, buf = _world(ratio)
    got = {}
    for a, b in zip(bounds, bounds[1:]):
        plan = C.make_plan(ratio, is_prefill=True, req_pool_indices=torch.tensor([rid]),
                           seq_lens=torch.tensor([b]), extend_lens=torch.tensor([b - a]), **slots)
        out = C.compress_forward(buf, rows[a:b], ape, plan, head_dim=HD, compress_ratio=ratio)
        for seq, row in zip(plan.seq_len.tolist(), out):
            got[seq // ratio - 1] = row
    for p in range(decode_from or rows.shape[0], rows.shape[0]):
        plan = C.make_plan(ratio, is_prefill=False, req_pool_indices=torch.tensor([rid]),
                           seq_lens=torch.tensor([p + 1]), extend_lens=None, **slots)
        out = C.compress_forward(buf, rows[p:p + 1], ape, plan, head_dim=HD, compress_ratio=ratio)
        if (p + 1) % ratio == 0:
            got[(p + 1) // ratio - 1] = out[0]
    return torch.stack([got[g] for g in sorted(got)]), sorted(got)


@pytest.mark.parametrize("ratio", [4, 128])
@pytest.mark.parametrize("chunk", [256, 512, 100, L])
def test_chunked_prefill_matches_the_documented_rule(ratio, chunk):
    rows, ape = _inputs(ratio, L, seed=ratio)
    ref = C.reference_groups(rows, ape, ratio, HD)
    got, groups = _run(ratio, rows, ape, sorted({*range(0, L, chunk), L}))
    assert groups == list(range(L // ratio))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio", [4, 128])
def test_chunked_at_256_and_512_equal_one_pass(ratio):
    rows, ape = _inputs(ratio, L, seed=7)
    one, _ = _run(ratio, rows, ape, [0, L])
    for chunk in (256, 512):
        got, _ = _run(ratio, rows, ape, sorted({*range(0, L, chunk), L}))
        torch.testing.assert_close(got, one, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ratio", [4, 128])
def test_decode_continues_the_ring(ratio):
    """Prefill 700 rows in chunks of 256, then decode to L one token at a time."""
    rows, ape = _inputs(ratio, L, seed=11)
    ref = C.reference_groups(rows, ape, ratio, HD)
    got, groups = _run(ratio, rows, ape, [0, 256, 512, 700], decode_from=700)
    assert groups == list(range(L // ratio))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_ring_holds_the_partial_group_across_chunks():
    """Control: with the ring wiped between chunks, groups straddling a chunk boundary differ."""
    ratio = 128
    rows, ape = _inputs(ratio, L, seed=3)
    ref = C.reference_groups(rows, ape, ratio, HD)
    slots, buf = _world(ratio)
    outs = []
    for a, b in ((0, 300), (300, 600)):
        plan = C.make_plan(ratio, is_prefill=True, req_pool_indices=torch.tensor([0]),
                           seq_lens=torch.tensor([b]), extend_lens=torch.tensor([b - a]), **slots)
        outs.append(C.compress_forward(buf, rows[a:b], ape, plan, head_dim=HD, compress_ratio=ratio))
        buf.zero_()
    straddling = outs[1][0]            # group 2 = positions 256..383, split at 300
    assert (straddling - ref[2]).abs().max() > 1e-2


def test_two_requests_in_one_batch_keep_their_own_rings():
    ratio = 4
    rows, ape = _inputs(ratio, 600, seed=5)
    other, _ = _inputs(ratio, 600, seed=6)
    slots, buf = _world(ratio)
    got = {0: {}, 1: {}}
    for a, b in ((0, 256), (256, 600)):
        plan = C.make_plan(ratio, is_prefill=True, req_pool_indices=torch.tensor([0, 1]),
                           seq_lens=torch.tensor([b, b]), extend_lens=torch.tensor([b - a, b - a]), **slots)
        out = C.compress_forward(buf, torch.cat([rows[a:b], other[a:b]]), ape, plan, head_dim=HD,
                                 compress_ratio=ratio)
        for seq, row_id, row in zip(plan.seq_len.tolist(), plan.out_row.tolist(), out):
            got[int(row_id >= b - a)][seq // ratio - 1] = row
    for req, src in ((0, rows), (1, other)):
        ref = C.reference_groups(src, ape, ratio, HD)
        torch.testing.assert_close(torch.stack([got[req][g] for g in sorted(got[req])]), ref,
                                   rtol=1e-5, atol=1e-5)


def _plan_per_token(ratio, rids, seqs, exts, slots):
    """The planner's rule token by token (c_plan.cuh, one thread per token): the oracle for the
    vectorised make_plan. Returns (outputs, writes): outputs as (seq_len, ragged row, [(from
    input, input row or ring slot, present)] * W), writes as (ragged row, ring slot)."""
    w = C.window(ratio)
    mtp_pad = slots["ring_size"] - w + 2 if slots["ring_size"] > w else 0
    slots = dict(slots, use_req_ring=False)
    outs, writes, base = [], [], 0
    for rid, seq, ext in zip(rids, seqs, exts):
        prefix = seq - ext
        first_w = min(seq // ratio * ratio - (ratio if ratio == 4 else 0), seq - mtp_pad)
        for j in range(ext):
            pos = prefix + j
            if (pos + 1) % ratio == 0:
                entries = []
                for q in range(pos + 1 - w, pos + 1):
                    if q >= prefix:
                        entries.append((True, base + q - prefix, True))
                    elif q >= 0:
                        slot = C.ring_slots(ratio, torch.tensor([rid]), torch.tensor([q]), **slots)
                        entries.append((False, int(slot), True))
                    else:
                        entries.append((False, 0, False))
                outs.append((pos + 1, base + j, entries))
            if pos >= first_w or (ratio == 4 and pos % SWA_PAGE >= SWA_PAGE - ratio):
                slot = C.ring_slots(ratio, torch.tensor([rid]), torch.tensor([pos]), **slots)
                writes.append((base + j, int(slot)))
        base += ext
    return outs, writes


@pytest.mark.parametrize("ratio", [4, 128])
def test_vectorised_plan_matches_the_per_token_rule(ratio):
    """A batch of three requests at different points of their prompts (first chunk, a middle
    chunk straddling SWA pages, a short tail), on a shuffled req_to_token / full_to_swa."""
    slots, _ = _world(ratio, n_reqs=3)
    g = torch.Generator().manual_seed(4)
    slots["req_to_token"] = torch.randperm(slots["req_to_token"].numel(), generator=g).to(
        torch.int32).view_as(slots["req_to_token"])
    slots["full_to_swa"] = torch.randperm(slots["full_to_swa"].numel(), generator=g)
    rids, seqs, exts = [2, 0, 1], [300, 1100, 520], [300, 600, 9]
    plan = C.make_plan(ratio, is_prefill=True, req_pool_indices=torch.tensor(rids),
                       seq_lens=torch.tensor(seqs, dtype=torch.int32),
                       extend_lens=torch.tensor(exts, dtype=torch.int32), **slots)
    outs, writes = _plan_per_token(ratio, rids, seqs, exts, slots)
    assert plan.seq_len.tolist() == [o[0] for o in outs]
    assert plan.out_row.tolist() == [o[1] for o in outs]
    for i, (_, _, entries) in enumerate(outs):
        got = [(bool(f), int(r if f else s), bool(p)) for f, r, s, p in zip(
            plan.from_input[i], plan.input_row[i], plan.state_slot[i], plan.present[i])]
        assert got == entries, i
    assert list(zip(plan.write_row.tolist(), plan.write_slot.tolist())) == writes
    assert all(t.dtype == torch.int64 for t in (plan.seq_len, plan.out_row, plan.input_row,
                                                plan.state_slot, plan.write_row, plan.write_slot))


def test_decode_plan_keeps_no_reference_to_the_callers_seq_lens():
    slots, _ = _world(4)
    seq_lens = torch.tensor([9], dtype=torch.int64)
    plan = C.make_plan(4, is_prefill=False, req_pool_indices=torch.tensor([1]), seq_lens=seq_lens,
                       extend_lens=None, **slots)
    seq_lens += 1                          # the scheduler advances its own tensor in place
    assert plan.seq_len.tolist() == [9]
    assert plan.write_row.tolist() == [0]
    assert plan.write_slot.tolist() == C.ring_slots(4, torch.tensor([1]), torch.tensor([8]),
                                                    use_req_ring=False, **slots).tolist()
