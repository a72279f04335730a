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
