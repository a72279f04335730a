"""Stand-ins for sglang.kernels.ops.attention.dsv4.norm_rope (CUDA-JIT: main_norm_rope.cuh,
rope.cuh, fused_norm_rope.cuh) and for the CPU rope factory, in plain torch.

CPU servers only (installed by adapter.cpu.dsv4.install); nothing in production imports this.
The rules are the kernels' own, read from the .cuh sources the engine ships:
- RoPE acts on the last 64 dims as interleaved (real, imag) pairs times `freqs_cis[position]`
  (complex64; conjugated when `inverse`);
- RMSNorm is x * rsqrt(mean(x^2) + eps) (* weight when one is given), in fp32;
- the indexer query: RoPE, then a 128-point Hadamard scaled by 1/sqrt(128), then one fp8 scale
  per (token, head) = max(1e-4, amax) / 448; weights_out = weight * weight_scale * scale.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
ROPE_DIM = 64


def rope(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
         inverse: bool = False) -> torch.Tensor:
    """fp32 rotary embedding of the last 64 dims of x [..., T-major] (interleaved pairs)."""
    out = x.float().clone()
    freqs = freqs_cis[positions.to(torch.int64)]                      # [T, 32] complex
    if inverse:
        freqs = freqs.conj()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (ROPE_DIM // 2,)
    tail = torch.view_as_complex(out[..., -ROPE_DIM:].contiguous().view(*x.shape[:-1], ROPE_DIM // 2, 2))
    out[..., -ROPE_DIM:] = torch.view_as_real(tail * freqs.view(shape)).flatten(-2)
    return out


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight.float()


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Sylvester-order Walsh-Hadamard transform of the last dim (a power of 2), / sqrt(n)."""
    n = x.shape[-1]
    out = x.float().reshape(-1, n)
    h = 1
    while h < n:
        out = out.view(-1, n // (2 * h), 2, h)
        out = torch.stack((out[:, :, 0] + out[:, :, 1], out[:, :, 0] - out[:, :, 1]), dim=2)
        h *= 2
    return (out.reshape(x.shape) / n ** 0.5)


def fused_rope_inplace(q, k, freqs_cis, positions, inverse=False):
    """Stand-in for norm_rope.fused_rope_inplace (production: CUDA-JIT rope.cuh)."""
    for t in (q, k):
        if t is not None:
            t.copy_(rope(t, freqs_cis, positions, inverse).to(t.dtype))


def fused_norm_rope_inplace(kv, weight, eps, freq_cis, positions):
    """Stand-in for norm_rope.fused_norm_rope_inplace (production: CUDA-JIT fused_norm_rope.cuh)."""
    kv.copy_(rope(rms_norm(kv, weight, eps), freq_cis, positions).to(kv.dtype))


def fused_q_norm_rope(q_input, q_output, eps, freqs_cis, positions):
    """Stand-in for norm_rope.fused_q_norm_rope (production: CUDA-JIT main_norm_rope.cuh): per-head
    weightless RMSNorm (skipped when eps is None), RoPE, bf16 rounding, then the output dtype."""
    q = q_input.float() if eps is None else rms_norm(q_input, None, eps)
    q_output.copy_(rope(q, freqs_cis, positions).to(q_input.dtype).to(q_output.dtype))


def fused_q_indexer_rope_hadamard_quant(q_input, weight, weight_scale, freqs_cis, positions):
    """Stand-in for norm_rope.fused_q_indexer_rope_hadamard_quant (production: CUDA-JIT
    main_norm_rope.cuh `fused_q_indexer_rope_hadamard_quant`). Returns (q fp8 [T, H, 128],
    weights [T, H, 1] fp32)."""
    q = hadamard(rope(q_input, freqs_cis, positions))
    scale = q.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX
    q_fp8 = (q / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    weights = weight.float().reshape(scale.shape) * float(weight_scale) * scale
    return q_fp8, weights


def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache,
                               page_size, layout="v4", q=None):
    """Stand-in for norm_rope.fused_k_norm_rope_flashmla (production: CUDA-JIT main_norm_rope.cuh,
    RMSNorm + RoPE + the V4 FlashMLA-layout store): the store is the engine kit's
    `set_k_and_s_torch` (adapter.cpu.dsv4.attention.store_k). V4 layout only."""
    from adapter.cpu.dsv4.attention import store_k
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    assert q is None and KVLayout.parse(layout) is KVLayout.V4, "CPU stand-in: V4 layout, no q"
    k = rope(rms_norm(kv, kv_weight, eps), freqs_cis, positions).to(torch.bfloat16)
    keep = out_loc >= 0
    store_k(kvcache, out_loc[keep], k[keep], page_size)


def get_rope_wrapper(head_size, rotary_dim, max_position, base, is_neox_style=True,
                     rope_scaling=None, dtype=None, partial_rotary_factor=1.0, device=None):
    """Stand-in for rotary_embedding.factory.get_rope_wrapper on CPU (production: the CUDA
    `get_rope`). The engine's CPU factory asserts a deepseek_yarn rope_scaling, which the
    ratio-0 layers do not have: those get the engine's own torch `RotaryEmbedding`; every other
    call goes to the engine's factory unchanged. The DSV4 forward ropes through `freqs_cis`."""
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    if rope_scaling is not None:
        return _ENGINE_GET_ROPE_WRAPPER(head_size, rotary_dim, max_position, base, is_neox_style,
                                        rope_scaling, dtype, partial_rotary_factor, device)
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, is_neox_style,
                           dtype or torch.get_default_dtype())


_ENGINE_GET_ROPE_WRAPPER = None     # the engine's factory, kept by install()
