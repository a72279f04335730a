"""The CPU mHC and norm/rope stand-ins (adapter/cpu/dsv4/mhc.py, norm_rope.py).

hc_split_sinkhorn is the engine's own torch reference (sglang.test.kernels.mhc), so it is
checked for its documented properties (doubly stochastic comb); mhc_combine and the rope /
Hadamard / indexer-q rules are checked against the rules in the engine's Triton / .cuh sources
(mhc.py `_mhc_combine_kernel` docstring, main_norm_rope.cuh)."""
import torch

from adapter.cpu.dsv4 import mhc, norm_rope


def test_sinkhorn_comb_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    mixes = torch.randn(3, 1, 24, generator=g)
    pre, post, comb = mhc.hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros(24), 4, 20, 1e-6)
    torch.testing.assert_close(comb.sum(-1), torch.ones(3, 1, 4), atol=1e-3, rtol=0)
    torch.testing.assert_close(comb.sum(-2), torch.ones(3, 1, 4), atol=1e-3, rtol=0)
    assert bool((pre > 0).all()) and bool((post > 0).all())


def test_mhc_combine_rule():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 4 * 16, generator=g)
    pre = torch.rand(5, 4, generator=g)
    want = sum(pre[:, k:k + 1] * x[:, k * 16:(k + 1) * 16] for k in range(4))
    torch.testing.assert_close(mhc.mhc_combine(x, pre, 4, torch.float32), want, atol=1e-6, rtol=1e-6)


def test_rope_rotates_pairs_and_inverse_undoes_it():
    freqs = torch.polar(torch.ones(10, 32), torch.rand(10, 32))
    x = torch.randn(3, 2, 128)
    pos = torch.tensor([0, 4, 9])
    y = norm_rope.rope(x, freqs, pos)
    torch.testing.assert_close(y[..., :64], x[..., :64])              # nope part untouched
    pair = torch.view_as_complex(x[1, 0, 64:].view(32, 2)) * freqs[4]
    torch.testing.assert_close(y[1, 0, 64:], torch.view_as_real(pair).flatten())
    torch.testing.assert_close(norm_rope.rope(y, freqs, pos, inverse=True), x, atol=1e-5, rtol=1e-5)


def test_hadamard_is_orthonormal_and_sylvester():
    h = norm_rope.hadamard(torch.eye(128))
    torch.testing.assert_close(h @ h.T, torch.eye(128), atol=1e-5, rtol=0)
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    syl = h2
    for _ in range(6):
        syl = torch.kron(syl, h2)
    torch.testing.assert_close(h, syl / 128 ** 0.5, atol=1e-6, rtol=0)


def test_indexer_q_quant_rule():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 3, 128, generator=g)
    w = torch.rand(4, 3, generator=g)
    freqs = torch.polar(torch.ones(8, 32), torch.rand(8, 32, generator=g))
    pos = torch.tensor([0, 1, 5, 7])
    q8, weights = norm_rope.fused_q_indexer_rope_hadamard_quant(q, w, 0.5, freqs, pos)
    ref = norm_rope.hadamard(norm_rope.rope(q, freqs, pos))
    scale = ref.abs().amax(-1, keepdim=True) / 448.0
    torch.testing.assert_close(q8.float() * scale, ref, atol=0.07 * float(scale.max()) * 448 / 16, rtol=0.07)
    torch.testing.assert_close(weights, w[..., None] * 0.5 * scale)
