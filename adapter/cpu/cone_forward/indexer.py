"""Stands in for the c4 indexer's query side (sglang.srt.layers.attention.dsv4.indexer:
C4Indexer.compute_q / compute_weights, fused CUDA kernels in production) in cone's proof: fp8
queries and head weights from a row's hidden state. The indexer's logits and top-k are the
engine's own (torch). Tests and benches only.
"""
from __future__ import annotations

import torch

from adapter.cpu.cone_forward.model import INDEX_HEADS, _mm


class IndexerInputs:
    """The c4 indexer's query side for one layer (production: C4Indexer.compute_q /
    compute_weights, fused CUDA kernels): fp8 queries and head weights from the row's hidden."""

    use_fp4_indexer = False
    compressor = None
    weight_scale = None
    index_topk = 512

    def __init__(self, layer_id: int, x: torch.Tensor, weights):
        from adapter.cpu.dsv4.attention import FP8, FP8_MAX

        self.layer_id = layer_id
        q = _mm(x, weights.index_q).float().view(x.shape[0], INDEX_HEADS, 128)
        scale = (q.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(1e-8)
        self._q = (q / scale).to(FP8)
        self._w = (_mm(x, weights.index_w).float() * scale.squeeze(-1)).unsqueeze(-1)

    def compute_weights(self, x, skip_scale=False):
        return self._w

    def compute_q(self, q_lora, positions, weights, q_lora_quant=None):
        return self._q, self._w

