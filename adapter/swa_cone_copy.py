"""Forward side of cone replay: torch functions over the engine's real DSV4 pool tensors.

A cone replay prefills [s, L) for a request whose cached prefix [0, F) has full KV resident but
no SWA window at F. Its first pass carries N = F - s "replay rows" in front of the new tokens:

- copy_resident(): the resident compressed latents (every compress ratio's KV pool, all layers)
  and indexer keys of [s, F) are copied into the replay rows' fresh pages, byte for byte. The
  compressed pools and the indexer pools are addressed `slot = full loc // ratio` with
  `page = page_size // ratio` (DeepSeekV4TokenToKVPool._init_compressed_pools), so a 256-token
  full page maps onto whole pages of every compressed pool and the copy moves whole pages:
  data rows and scale rows together, whatever the KVLayout (V4 / V41 / interleaved / fp4).
- keep_rows(): the batch rows whose compressor writes are kept. The engine's own
  `DeepseekV4AttnBackend._compressor_out_loc` sends every other row's latent / index-key write to
  slot 0 (the padding slot the paged allocator reserves) when `encoder_swa_compress_rows` is set,
  so the copied bytes stay as they are.
- row_floor(): each row's sliding-window floor (s for the rows of a replaying request, 0 for the
  others), in the engine's `swa_replay_start` / `encoder_swa_row_floor` form: a row never reads a
  window slot below s (those SWA slots were evicted; the allocator cleared their mapping to the
  padding slot).

Rows >= F then compute what a prefix hit at F computes: their full-attention reads see the
resident latents, their window sees the replayed [F-128, F) (bit-equal inside the engine's
backend: bench/cone_forward.py). The floor keeps the replay rows' own reads inside the request;
rows >= F depend on it only through the model's cone, which N covers.

copy_resident may raise after moving some buffers (UnsupportedPool, the ValueError of its page
checks, torch.OutOfMemoryError from index_select, ...): the replay rows then hold neither the
resident bytes nor their own. Its caller (swa_cone.Cone.apply) fails that request; check_pool()
lets the match side refuse an unaddressable pool before any plan.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

PADDING_SLOT = 0  # the paged allocator's reserved dummy slot (page 0)


class UnsupportedPool(Exception):
    """The pool keeps compressed state in a layout the page copy cannot address."""


@dataclasses.dataclass(frozen=True)
class CopyReport:
    full_pages: int       # 256-token full pages copied
    buffers: int          # per-layer buffers touched (latent + index-key)
    bytes: int            # bytes copied in all


def full_pages(loc: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of a page-aligned run of full-pool slots (each page's slots contiguous)."""
    loc = loc.to(torch.int64).flatten()
    if loc.numel() % page_size:
        raise ValueError(f"{loc.numel()} slots is not a whole number of {page_size}-token pages")
    pages = loc.view(-1, page_size)
    first = pages[:, 0]
    if bool((first % page_size).ne(0).any()) or bool(
            (pages - first[:, None]).ne(torch.arange(page_size, device=loc.device)).any()):
        raise ValueError("slots are not whole, contiguous pages")
    return first // page_size


def _check_supported(pool) -> None:
    if getattr(pool, "unified_kv_pool", None) is not None:
        raise UnsupportedPool("unified_kv pool (request-addressed rows, no paged latents)")
    for ratio, kv in getattr(pool, "kv_pools", {}).items():
        if kv is not None and type(kv).__name__ == "HiSparseC4DevicePool":
            raise UnsupportedPool("HiSparse C4 pool (slots remapped to a device subset)")


def check_pool(pool, page_size: int) -> None:
    """Raise UnsupportedPool unless copy_resident can move whole pages of every latent and
    index-key pool of `pool`. Reads only the pool's layout (the same on every TP rank), so the
    match side can decide before admission: a replay is planned only where its copy can run."""
    _check_supported(pool)
    one_page = torch.zeros(1, dtype=torch.int64)
    for ratio, pool_page, _ in _page_buffers(pool):
        _pool_pages(one_page, page_size, ratio, pool_page)


def _page_buffers(pool):
    """(ratio, pool page size, [2-D page-row uint8 views]) for every latent and index-key pool."""
    out = []
    for ratio, kv in sorted(getattr(pool, "kv_pools", {}).items()):
        if kv is None:
            continue
        views = [b.view(torch.uint8).view(b.shape[0], -1) for b in kv.kv_buffer]
        out.append((ratio, kv.page_size, views))
    for ratio, ix in sorted(getattr(pool, "index_pools", {}).items()):
        out.append((ratio, ix.page_size, list(ix.contiguous_page_row_buffers())))
    return out


def _pool_pages(full_page_ids: torch.Tensor, page_size: int, ratio: int, pool_page: int):
    slots_per_full_page = page_size // ratio
    if slots_per_full_page % pool_page:
        raise UnsupportedPool(f"ratio {ratio}: {slots_per_full_page} slots per full page do not "
                              f"fill whole {pool_page}-slot pages")
    k = slots_per_full_page // pool_page
    return (full_page_ids[:, None] * k + torch.arange(k, device=full_page_ids.device)).flatten()


def copy_resident(pool, src_loc: torch.Tensor, dst_loc: torch.Tensor, *,
                  page_size: int) -> CopyReport:
    """Copy the latents and index keys of full slots `src_loc` onto `dst_loc` (same length).

    `pool` is a DeepSeekV4TokenToKVPool; src/dst are page-aligned runs of full-pool slots (the
    resident prefix pages [s, F) and the replay rows' fresh pages). SWA is not touched: the replay
    rows write their own window.
    """
    _check_supported(pool)
    src_pages = full_pages(src_loc, page_size)
    dst_pages = full_pages(dst_loc, page_size)
    if src_pages.numel() != dst_pages.numel():
        raise ValueError("source and destination differ in length")
    if bool(torch.isin(dst_pages, src_pages).any()):
        raise ValueError("destination pages overlap the resident source pages")
    buffers = nbytes = 0
    for ratio, pool_page, views in _page_buffers(pool):
        src = _pool_pages(src_pages, page_size, ratio, pool_page)
        dst = _pool_pages(dst_pages, page_size, ratio, pool_page)
        for view in views:
            src_d, dst_d = src.to(view.device), dst.to(view.device)
            view.index_copy_(0, dst_d, view.index_select(0, src_d))
            buffers += 1
            nbytes += dst_d.numel() * view.shape[1]
    return CopyReport(int(src_pages.numel()), buffers, nbytes)


def keep_rows(extend_lens: Sequence[int], replay_lens: Sequence[int], *,
              device=None) -> torch.Tensor:
    """Rows (in batch row order) whose compressor writes are kept: all but each request's
    leading `replay_lens[i]` rows. The engine routes the other rows' writes to slot 0."""
    keep, off = [], 0
    for n, r in zip(extend_lens, replay_lens):
        if not 0 <= r <= n:
            raise ValueError(f"replay of {r} rows in an extend of {n}")
        keep.append(torch.arange(off + r, off + n, dtype=torch.int64))
        off += n
    rows = torch.cat(keep) if keep else torch.zeros(0, dtype=torch.int64)
    return rows if device is None else rows.to(device)


def masked_out_loc(out_cache_loc: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """What the compressors write to: out_cache_loc on kept rows, the padding slot elsewhere
    (the same rule as the engine's _compressor_out_loc; used where the engine's is not reached)."""
    return torch.full_like(out_cache_loc, PADDING_SLOT).index_copy_(0, keep, out_cache_loc[keep])


def row_floor(extend_lens: Sequence[int], floors: Sequence[int], *, device=None) -> torch.Tensor:
    """Per-row sliding-window floor: `floors[i]` (the replay start s, or 0) on request i's rows."""
    floor = torch.repeat_interleave(torch.tensor(list(floors), dtype=torch.int64),
                                    torch.tensor(list(extend_lens), dtype=torch.int64))
    return floor if device is None else floor.to(device)
