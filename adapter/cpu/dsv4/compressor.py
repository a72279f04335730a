"""Stand-ins for the DeepSeek-V4 KV compressor (sglang.kernels.ops.attention.dsv4.compress and its
planner), in torch. CPU servers and tests only; nothing in production imports this.

Production runs three CUDA-JIT pieces: the planner `c_plan.cuh` (`create_paged_compressor_data`),
the compressors `c4_v2.cuh` / `c128_v2.cuh` (`compress_forward`), and `fused_norm_rope_v2.cuh`
(`compress_norm_rope_store`). The rules below are theirs, read from those sources:

- A group of `ratio` tokens compresses when its last token (position p, (p + 1) % ratio == 0) is
  computed. c128: a per-dim softmax over the 128 tokens' scores (+ `ape` row i) weights their
  kv; input row = | kv | score |. c4 overlaps: 8 entries, the previous group's tokens
  (kv "overlap" half, score overlap half, ape rows 0..3) then the group's own (kv, score, ape
  rows 4..7); input row = | kv overlap | kv | score overlap | score |. The first c4 group (p < 4)
  has no previous group: those entries are kv 0, score -inf.
- Entries of a window before the extend's first token come from the state ring (the request's
  earlier chunks); the rest from this forward's input rows. Prefill compresses before it writes.
- Prefill writes to the ring every token at or after `first_w_pos` = min(last group start
  (- ratio for c4), seq_len - mtp_pad), plus, for c4 on the SWA-paged ring, the last 4 tokens
  of every SWA page. Decode writes its token, then compresses when seq_len % ratio == 0.
- Ring slot of position q: c128 (or c4 on a per-request ring): rid * ring + q % ring; c4 paged:
  swa_page(q) * ring + swa_loc(q) % ring, swa_loc = full_to_swa[req_to_token[rid, q]].
- Store: RMSNorm (weight), RoPE of the last 64 dims at the group's first position
  (seq_len - ratio); head_dim 128 (indexer) then Hadamard + one fp8 scale per row, else the
  bf16-rounded row in the V4 FlashMLA layout; at out_loc[ragged id] (prefill) or out_loc[b]
  (decode, only rows whose seq_len % ratio == 0).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


@dataclasses.dataclass
class TorchCompressPlan:
    """The plan of the CPU compressor (production: CompressorPrefillPlan / CompressorDecodePlan,
    uint8 structs built by c_plan.cuh). `plan[1]` has one row per compressed output, as there."""

    compress_ratio: int
    is_decode: bool
    seq_len: torch.Tensor        # [n_out] position + 1 of each group's last token
    out_row: torch.Tensor        # [n_out] ragged id (prefill) / batch index (decode)
    from_input: torch.Tensor     # [n_out, W] bool: entry read from this forward's input rows
    input_row: torch.Tensor      # [n_out, W] ragged row of the entry (when from_input)
    state_slot: torch.Tensor     # [n_out, W] ring slot of the entry (when not from_input)
    present: torch.Tensor        # [n_out, W] bool: False for c4's missing first overlap
    write_row: torch.Tensor      # [n_w] ragged rows written to the ring
    write_slot: torch.Tensor     # [n_w] their ring slots

    def __getitem__(self, i):
        if i == 1:
            return self.seq_len
        raise IndexError(i)

    def copy_(self, other) -> None:
        raise NotImplementedError("CPU compressor plans are not captured in graphs")


def window(ratio: int) -> int:
    return 8 if ratio == 4 else ratio


def ring_slots(ratio: int, rid: torch.Tensor, positions: torch.Tensor, *, req_to_token,
               full_to_swa, swa_page_size: int, ring_size: int, use_req_ring: bool) -> torch.Tensor:
    """Ring slots of (request pool index, position) pairs (c_plan.cuh compute_loc /
    compute_req_ring_loc)."""
    rid = rid.to(torch.int64)
    positions = positions.to(torch.int64)
    if ratio == 128 or use_req_ring:
        return rid * ring_size + positions % ring_size
    swa_loc = full_to_swa[req_to_token[rid, positions].to(torch.int64)].to(torch.int64)
    return (swa_loc // swa_page_size) * ring_size + swa_loc % ring_size


def make_plan(ratio: int, *, is_prefill: bool, req_pool_indices, seq_lens, extend_lens,
              req_to_token, full_to_swa, swa_page_size: int, ring_size: int,
              use_req_ring: bool = False) -> TorchCompressPlan:
    """The plan (stand-in for c_plan.cuh plan_compress_prefill / plan_compress_decode), built
    for every token of the batch at once (no per-token Python work)."""
    w = window(ratio)
    overlap = ratio == 4
    mtp_pad = ring_size - w + 2 if ring_size > w else 0
    slots = dict(req_to_token=req_to_token, full_to_swa=full_to_swa, swa_page_size=swa_page_size,
                 ring_size=ring_size, use_req_ring=use_req_ring)
    i64 = torch.int64
    rid = req_pool_indices.to(i64).view(-1)
    seq = seq_lens.to(i64, copy=True).view(-1)      # the plan keeps it: never the caller's tensor
    if not is_prefill:
        # decode: one token per request, always written to the ring (before it compresses), one
        # output row per request (the kernel's plan_d); only boundary rows are stored
        batch = torch.arange(seq.shape[0], dtype=i64)
        return TorchCompressPlan(
            ratio, True, seq, batch, *_decode_windows(ratio, rid, seq, **slots),
            write_row=batch, write_slot=ring_slots(ratio, rid, seq - 1, **slots))
    ext = extend_lens.to(i64).view(-1)
    prefix = seq - ext
    base = torch.cumsum(ext, 0) - ext                    # ragged row of each request's first token
    first_w = torch.minimum(seq // ratio * ratio - (ratio if overlap else 0), seq - mtp_pad)
    owner = torch.repeat_interleave(torch.arange(seq.shape[0], dtype=i64), ext)   # per token
    row = torch.arange(owner.shape[0], dtype=i64)        # ragged row of each token
    pos = prefix[owner] + row - base[owner]
    # a group compresses when its last token is computed
    out = (pos + 1) % ratio == 0
    out_row = row[out]
    out_owner = owner[out]
    out_seq = pos[out] + 1
    n = out_seq.shape[0]
    pos_t = out_seq.view(n, 1) - w + torch.arange(w, dtype=i64).view(1, w)
    prefix_t = prefix[out_owner].view(n, 1)
    present = pos_t >= 0
    from_input = pos_t >= prefix_t
    need_ring = present & ~from_input
    state_slot = torch.zeros((n, w), dtype=i64)
    if bool(need_ring.any()):
        rid_t = rid[out_owner].view(n, 1).expand(n, w)
        state_slot[need_ring] = ring_slots(ratio, rid_t[need_ring], pos_t[need_ring], **slots)
    write = pos >= first_w[owner]
    if overlap and not use_req_ring:
        write |= pos % swa_page_size >= swa_page_size - ratio
    w_row = row[write]
    write_slot = (ring_slots(ratio, rid[owner[write]], pos[write], **slots)
                  if w_row.numel() else torch.zeros(0, dtype=i64))
    input_row = (base[out_owner].view(n, 1) + pos_t - prefix_t).clamp_min(0) * from_input
    return TorchCompressPlan(ratio, False, out_seq, out_row, from_input, input_row, state_slot,
                             present, w_row, write_slot)


def _decode_windows(ratio, rid, seq, **slots):
    """Decode windows: every entry from the ring, read after the token's own write."""
    w = window(ratio)
    i64 = torch.int64
    n = seq.shape[0]
    pos = seq.view(n, 1) - w + torch.arange(w, dtype=i64).view(1, w)
    # Non-boundary rows compute garbage the store skips: read their slots from position >= 0.
    present = pos >= 0
    rid = rid.view(n, 1).expand(n, w)
    state_slot = torch.zeros((n, w), dtype=i64)
    if bool(present.any()):
        state_slot[present] = ring_slots(ratio, rid[present], pos[present], **slots)
    return torch.zeros((n, w), dtype=torch.bool), torch.zeros((n, w), dtype=i64), state_slot, present


def create_paged_compressor_data(compress_ratio, *, is_prefill, token_to_kv_pool, req_to_token,
                                 req_pool_indices, seq_lens, extend_lens=None, seq_lens_cpu=None,
                                 extend_lens_cpu=None, use_prefill_cuda_graph=False,
                                 num_q_tokens=None, online_state_slot_offset=0):
    """Stand-in for compressor_v2.create_paged_compressor_data (production: the CUDA-JIT planner
    c_plan.cuh through CompressorPrefillPlan.generate / CompressorDecodePlan.generate)."""
    assert not use_prefill_cuda_graph, "CPU compressor: no graphs"
    if is_prefill and seq_lens_cpu is not None:
        seq_lens, extend_lens = torch.tensor(seq_lens_cpu), torch.tensor(extend_lens_cpu)
    return make_plan(
        compress_ratio, is_prefill=is_prefill, req_pool_indices=req_pool_indices.cpu(),
        seq_lens=seq_lens.cpu(), extend_lens=None if extend_lens is None else extend_lens.cpu(),
        req_to_token=req_to_token, full_to_swa=token_to_kv_pool.full_to_swa_index_mapping.detach(),
        swa_page_size=token_to_kv_pool.swa_page_size,
        ring_size=token_to_kv_pool.get_ring_size(compress_ratio=compress_ratio),
        use_req_ring=compress_ratio == 4 and getattr(token_to_kv_pool, "_unified_kv", False))


def _entries(ratio: int, rows: torch.Tensor, head_dim: int):
    """(kv, score) per window entry from rows [..., W, last_dim] in the kernels' layouts."""
    hd = head_dim
    if ratio == 4:
        kv = torch.cat((rows[..., :4, 0:hd], rows[..., 4:, hd:2 * hd]), dim=-2)
        score = torch.cat((rows[..., :4, 2 * hd:3 * hd], rows[..., 4:, 3 * hd:4 * hd]), dim=-2)
        return kv, score
    return rows[..., 0:hd], rows[..., hd:2 * hd]


def compress_forward(kv_score_buffer, kv_score_input, ape, plan, *, head_dim, compress_ratio,
                     out=None, is_online=False):
    """Stand-in for compress.compress_forward (production: CUDA-JIT c4_v2.cuh / c128_v2.cuh):
    returns one compressed row per plan output [n_out, head_dim] and updates the state ring."""
    assert not is_online and plan.compress_ratio == compress_ratio
    ratio, w = compress_ratio, window(compress_ratio)
    last_dim = kv_score_input.shape[-1]
    ring = kv_score_buffer.view(-1, last_dim)
    if plan.is_decode and plan.write_row.numel():      # decode writes before it compresses
        ring[plan.write_slot] = kv_score_input[plan.write_row].to(ring.dtype)
    n = plan.seq_len.shape[0]
    # Entries come from this forward's rows or from the ring; gather only the sources in use
    # (decode: the ring only; a request's first chunk: its own rows only).
    use_input = not plan.is_decode and bool(plan.from_input.any())
    use_ring = plan.is_decode or not use_input or not bool(plan.from_input.all())
    if use_input:
        rows = kv_score_input[plan.input_row.view(-1)].float().view(n, w, last_dim)
    if use_ring:
        ring_rows = ring[plan.state_slot.view(-1)].float().view(n, w, last_dim)
        rows = torch.where(plan.from_input[..., None], rows, ring_rows) if use_input else ring_rows
    kv, score = _entries(ratio, rows, head_dim)
    score = score + ape.to(kv_score_input.dtype).float().view(w, head_dim)
    kv = torch.where(plan.present[..., None], kv, torch.zeros_like(kv))
    score = torch.where(plan.present[..., None], score, torch.full_like(score, float("-inf")))
    result = (torch.softmax(score, dim=1) * kv).sum(1)
    if not plan.is_decode and plan.write_row.numel():  # prefill writes after it compresses
        ring[plan.write_slot] = kv_score_input[plan.write_row].to(ring.dtype)
    if out is None:
        return result.to(kv_score_input.dtype)
    out.copy_(result)
    return out


def compressed_rows(kv: torch.Tensor, plan: TorchCompressPlan, *, norm_weight, norm_eps: float,
                    freq_cis: torch.Tensor, rotate: bool):
    """(kept mask, positions, rows) after norm + rope (+ Hadamard when `rotate`), fp32."""
    from adapter.cpu.dsv4.norm_rope import hadamard, rms_norm, rope

    seq = plan.seq_len
    keep = seq % plan.compress_ratio == 0 if plan.is_decode else torch.ones_like(seq, dtype=torch.bool)
    positions = (seq - plan.compress_ratio).clamp_min(0)
    rows = rope(rms_norm(kv, norm_weight, norm_eps), freq_cis, positions)
    if rotate:
        rows = hadamard(rows)
    return keep, positions, rows


def compress_norm_rope_store(kv, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache,
                             page_size, use_fp4=False, bf16_store=False, kvcache_scale=None,
                             rope_cache=None, fp4_k_write_metadata=None, layout="v4",
                             fp8_2buff=False, kvcache_rope=None):
    """Stand-in for compress.compress_norm_rope_store (production: CUDA-JIT fused_norm_rope_v2.cuh):
    head_dim 128 -> the fp8 index-K store, 512 -> the V4 FlashMLA latent store."""
    from adapter.cpu.dsv4.attention import store_index_k, store_k
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    assert not (use_fp4 or bf16_store or fp8_2buff), "CPU compressor: fp8 V4 stores only"
    assert KVLayout.parse(layout) is KVLayout.V4
    if kv.shape[0] == 0:
        return
    if plan.is_decode and not bool((plan.seq_len % plan.compress_ratio == 0).any()):
        return                                      # no group boundary in this decode step
    indexer = kv.shape[-1] == 128
    keep, _, rows = compressed_rows(kv, plan, norm_weight=norm_weight, norm_eps=norm_eps,
                                    freq_cis=freq_cis, rotate=indexer)
    loc = out_loc.to(torch.int64)[plan.out_row][keep]
    rows = rows[keep]
    if indexer:
        store_index_k(kvcache.view(kvcache.shape[0], -1), loc, rows, page_size)
    else:
        store_k(kvcache, loc, rows.to(torch.bfloat16), page_size)


def reference_groups(kv_score: torch.Tensor, ape: torch.Tensor, ratio: int, head_dim: int,
                     seq_len: Optional[int] = None) -> torch.Tensor:
    """Every compressed row of one request computed in one shot from all its rows
    [seq_len, last_dim] by the kernels' documented rule (no ring): the tests' reference."""
    w = window(ratio)
    n = (seq_len or kv_score.shape[0]) // ratio
    out = []
    for g in range(n):
        last = (g + 1) * ratio - 1
        pos = torch.arange(last + 1 - w, last + 1)
        rows = kv_score[pos.clamp_min(0)].float()
        kv, score = _entries(ratio, rows, head_dim)
        score = score + ape.float().view(w, head_dim)
        score[pos < 0] = float("-inf")
        kv[pos < 0] = 0
        out.append((torch.softmax(score, 0) * kv).sum(0))
    return torch.stack(out) if out else kv_score.new_zeros((0, head_dim)).float()
