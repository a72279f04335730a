"""Stand-in for the attention backend's compression metadata kernel (Triton), in torch.

Tests, benches and CPU servers only; nothing in production imports this.
"""
from __future__ import annotations

import torch


def init_compression_metadata_torch(seq_lens, positions, raw_out_loc, page_table=None,
                                    page_size=0, compute_page_indices=True):
    """Torch version of metadata_kernel.init_compression_metadata (production: the Triton kernel
    `_init_compressed_attn_metadata_kernel`); same nine outputs, same rule row by row."""
    device = seq_lens.device
    n_write = raw_out_loc.shape[0]
    seq = seq_lens.to(torch.int64)
    pos = positions.to(torch.int64)
    raw = raw_out_loc.to(torch.int64)
    out = []
    for ratio in (4, 128):
        compress = seq[:n_write] % ratio == 0
        out_loc = torch.where(compress, raw // ratio, torch.zeros_like(raw))
        c_pos = (pos & ~(ratio - 1)).to(torch.int32)
        c_raw = (seq // ratio).to(torch.int32)
        out += [out_loc, c_pos, c_raw, c_raw.clamp_min(1)]
    page_indices = None
    if compute_page_indices:
        assert page_table is not None and page_size >= 128 and page_size % 128 == 0
        c128_page = page_size // 128
        width = c128_page * page_table.shape[1]
        offsets = torch.arange(width, device=device)
        slots = (page_table.to(torch.int64)[:, offsets // c128_page] * c128_page
                 + offsets % c128_page)
        valid = offsets[None, :] < (seq // 128)[:, None]
        page_indices = torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
    return (*out, page_indices)
