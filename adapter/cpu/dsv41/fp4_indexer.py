"""Stand-in for sglang.kernels.ops.attention.dsv4.fp4_indexer.fp4_index_logits_decode (Triton
`_fp4_index_logits_kernel`), which v41_indexer/scoring.py imports by name for the ratio-1/2 index
layers' decode scores off SM90 (CPU takes that branch; GB10 takes DeepGEMM's paged logits).

CPU servers only (installed by adapter.cpu.dsv41.install); nothing in production imports this.
The kernel's rule, from its source (`_fp4_index_logits_tile`):
- each visible position's key is read from the fp4 index-K page at its slot and decoded to bf16
  (nibble value x its 32-group's 2^(exp - 127));
- per head, the fp32 dot product of the bf16 query and key, rounded to bf16, then relu, times
  the head weight (bf16), rounded to bf16; summed over heads in fp32, rounded to bf16;
- positions at or past `lens[b]` score -inf.
"""
from __future__ import annotations

import torch

from adapter.cpu.dsv41.fp4_index_k import HEAD_DIM, dequantize_rows, first_call


def fp4_index_logits_decode(q: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor,
                            lens: torch.Tensor, table: torch.Tensor, page_size: int) -> torch.Tensor:
    """q [B, H, 128] bf16, weights [B, H], slots [B, L] int64, lens [B], table the layer's index-K
    pages (uint8 [pages, page_size * 68]) -> [B, L] fp32 logits, -inf at positions >= lens."""
    assert q.dtype == torch.bfloat16 and q.shape[-1] == HEAD_DIM
    assert table.dtype == torch.uint8 and table.dim() == 2
    B, H, _ = q.shape
    L = slots.shape[1]
    out = torch.full((B, L), float("-inf"), dtype=torch.float32)
    first_call("fp4_index_logits_decode", f"first call: {B} rows x {L} positions")
    if L == 0 or B == 0:
        return out
    valid = torch.arange(L)[None, :] < lens.to(torch.int64).view(-1, 1).clamp_max(L)
    k = dequantize_rows(table, slots.to(torch.int64).reshape(-1).clamp_min(0), page_size)
    k = k.float().view(B, L, HEAD_DIM)
    w = weights.to(torch.bfloat16).float()                                          # [B, H]
    acc = torch.einsum("bhd,bld->bhl", q.float(), k)                               # fp32
    s = acc.to(torch.bfloat16).float().clamp_min(0.0)
    s = (s * w[:, :, None]).to(torch.bfloat16).float()
    logit = s.sum(dim=1).to(torch.bfloat16).float()
    return torch.where(valid, logit, out)
