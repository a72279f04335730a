"""Stand-ins for sglang.kernels.ops.layernorm.mhc (the DeepSeek-V4 hyper-connections), in torch.

CPU servers only (installed by adapter.cpu.dsv4.install); nothing in production imports this.
"""
from __future__ import annotations

import torch


def hc_split_sinkhorn(mixes, hc_scale, hc_base, hc_mult=4, sinkhorn_iters=20, eps=1e-6):
    """Stand-in for mhc.hc_split_sinkhorn (production: the TileLang kernel
    `hc_split_sinkhorn_kernel`): the engine's own pure-torch reference,
    sglang.test.kernels.mhc.hc_split_sinkhorn_torch."""
    from sglang.test.kernels.mhc import hc_split_sinkhorn_torch

    return hc_split_sinkhorn_torch(mixes, hc_scale, hc_base, hc_mult, sinkhorn_iters, eps)


def mhc_combine(x_flat: torch.Tensor, pre: torch.Tensor, hc: int, out_dtype: torch.dtype):
    """Stand-in for mhc.mhc_combine (production: the Triton `_mhc_combine_kernel`), its
    documented rule y[m, h] = sum_k pre[m, k] * x_flat[m, k*H + h], accumulated in fp32."""
    m = x_flat.shape[0]
    x = x_flat.float().view(m, hc, x_flat.shape[1] // hc)
    return torch.einsum("mk,mkh->mh", pre.float(), x).to(out_dtype)


def fused_hc_head(x, hc_fn, hc_scale, hc_base, norm_eps, hc_eps):
    """Stand-in for mhc_head.fused_hc_head, the LM-head mixer (production: the Triton
    `_hc_head_kernel`): the engine's own torch version, deepseek_v4.hc_head_torch, which the
    model itself runs for an empty batch."""
    from sglang.srt.models.deepseek_v4 import hc_head_torch

    return hc_head_torch(x, hc_fn, hc_scale, hc_base, norm_eps=norm_eps, hc_eps=hc_eps)
