"""Stands in for the model (sglang.srt.models.deepseek_v4: DeepseekV4ForCausalLM's decoder
layers) in cone's proof: "a tiny stack" of three attention layers with compress ratios 0, 4, 128
(page 256, window 128 as on the cluster). Each row's hidden state starts from its token's
embedding and adds each layer's attention output through a projection, so a layer's queries, SWA
keys, compressed latents and index keys depend on what the layers below read: the model's
receptive cone, which cone's floor at s shapes. Tests and benches only.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

PAGE = 256
WINDOW = 128
RATIOS = (0, 4, 128)
HEADS = 8
INDEX_HEADS = 4
DIM = 512
VOCAB = 509
CONTEXT = 4096


class Stack:
    """Deterministic weights of the three layers (bf16; row-independent CPU matmuls)."""

    def __init__(self, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)

        def w(rows, cols, scale):
            return (torch.randn(rows, cols, generator=g) * scale).to(torch.bfloat16)

        self.embed = w(VOCAB, DIM, 1.0)
        self.layers = []
        for _ in RATIOS:
            self.layers.append(SimpleNamespace(
                q=w(DIM, HEADS * DIM, 2.0 / DIM ** 0.5), k=w(DIM, DIM, 1.0 / DIM ** 0.5),
                latent=w(DIM, DIM, 1.0 / DIM ** 0.5), index_k=w(DIM, 128, 1.0 / DIM ** 0.5),
                index_q=w(DIM, INDEX_HEADS * 128, 1.0 / DIM ** 0.5),
                index_w=w(DIM, INDEX_HEADS, 1.0 / DIM ** 0.5),
                o=w(HEADS * DIM, DIM, 0.5 / (HEADS * DIM) ** 0.5),
                sink=(torch.randn(HEADS, generator=g)).float()))

    def tokens(self, positions: torch.Tensor) -> torch.Tensor:
        return (positions * 2654435761 + 12345) % VOCAB



def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stack's projections: bf16 operands multiplied in float64 and rounded to bf16: fast on
    CPU, and a row's bf16 result does not move with the batch's row count (float32 GEMM here
    does, by a few ulps)."""
    return (x.double() @ w.double()).to(torch.bfloat16)

