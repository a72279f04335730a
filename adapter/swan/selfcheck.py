"""swan's self-check at first use (DSV41_SWAN_SELFCHECK, on by default with swan).

The first call of every new decode key (the router's decision cache: one entry per distinct call
metadata, so one per decode row count x layer shape) runs both the in-place path (the router's
kernel: swan256.so on a GB10, the CPU twin without CUDA) and the engine's stock split path on the
same inputs and compares what they return bit for bit (the output, and the LSE where the entry
returns one: the pinned engine's flashinfer route returns None there). Then every rank of the
attention TP group agrees before the verdict takes effect: one all-reduce (MAX) over the group's
gloo CPU group of [this rank differs, this rank's routing refused the key] and of the key's
fingerprint (check number, rows, heads, topk, extra topk; negated too, so that MAX also gives
the MIN), so either every rank serves the key in place or none does. The verdict reads no clock
and nothing random: the bits of two deterministic computations on the same inputs, reduced over
the group.

  * equal on every rank: the key is served in place from then on (counter selfcheck_verified);
  * different on any rank: the key keeps the stock split on every rank, with a fallback line
    naming the key, the first differing element and both values (counter selfcheck_failed);
    with DSV41_SWAN_SELFCHECK=2, swan as a whole falls back (every key, also those verified);
  * the checked call itself returns the stock path's answer (equal bits when verified).

Under CUDA-graph capture a key that is not decided yet is not checked (no sync, no collective in
a capture): that call takes the stock split and the key stays pending. The engine runs two
warm-up forwards of every captured shape outside the graph first (full_cuda_graph_backend
capture_one), so the check runs there and the capture records what was verified.

Test only: DSV41_SWAN_SELFCHECK_TEST_PLANT=<rank> plants a one-byte error in the in-place read on
that attention-TP rank (a copy of the pool in which one scale byte of a token a row attends is
raised by 32, i.e. x 2^32; the engine's pool is never written), in every in-place call, checked
or served.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from adapter.tp_group import all_reduce_max, engine_group  # noqa: F401 - engine_group: swan's seam

KEY = "DSV41_SWAN_SELFCHECK"
PLANT_KEY = "DSV41_SWAN_SELFCHECK_TEST_PLANT"
OFF, PER_KEY, WHOLE = 0, 1, 2

# Counter keys in receipts.counters["swan"] (series: adapter/metrics.py KEYS)
VERIFIED = "selfcheck_verified"
FAILED = "selfcheck_failed"

CAPTURE_REASON = ("self-check pending: key first seen under CUDA-graph capture (this call keeps "
                  "the stock split; the key is checked at its first call outside a capture)")
PLANT_SCALE_UP = 32     # the planted change: a UE8M0 scale exponent raised by 32 (x 2^32)


class _Pending:
    """The decision of a key whose self-check has not run yet (a sentinel reason: the router's
    served path compares reasons with None only, so a pending key costs it nothing)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<swan self-check pending>"


PENDING = _Pending()


# ---------------------------------------------------------------------------------------------
# bit-for-bit comparison

def _bits(t):
    """The tensor's bytes as integers of its element size (NaN and -0.0 compare by their bits)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype.is_floating_point or t.dtype.is_complex:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        t = t.view(ints[t.element_size()])
    return t


def _value(t, flat: int) -> str:
    bits = _bits(t).reshape(-1)[flat].item() & ((1 << (8 * t.element_size())) - 1)
    return f"{t.reshape(-1)[flat].item():.6g} (0x{bits:0{2 * t.element_size()}x})"


def compare_tensor(name: str, got, want) -> Optional[str]:
    """None when `got` and `want` are the same bits (or both None), else where they first differ
    and both values."""
    import torch

    if got is None or want is None:
        if got is None and want is None:
            return None
        return f"{name}: in-place {'None' if got is None else 'a tensor'}, stock {'None' if want is None else 'a tensor'}"
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return f"{name}: in-place {type(got).__name__}, stock {type(want).__name__}"
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return (f"{name}: in-place {str(got.dtype).replace('torch.', '')}{list(got.shape)}, "
                f"stock {str(want.dtype).replace('torch.', '')}{list(want.shape)}")
    a, b = _bits(got).to(want.device), _bits(want)
    diff = (a != b).reshape(-1)
    if not bool(diff.any()):
        return None
    flat = int(diff.nonzero()[0, 0])
    index, rest = [], flat
    for size in reversed(got.shape):
        index.append(rest % size)
        rest //= size
    where = ", ".join(str(i) for i in reversed(index))
    return (f"{name}[{where}] in-place {_value(got, flat)} != stock {_value(want, flat)} "
            f"({int(diff.sum())} of {diff.numel()} elements differ)")


def compare(got, want) -> Optional[str]:
    """Compare what the in-place path and the stock entry returned: (output, lse) tuples (lse
    None on the pinned engine's flashinfer route), or a bare tensor."""
    if isinstance(want, tuple) or isinstance(got, tuple):
        if not (isinstance(want, tuple) and isinstance(got, tuple)) or len(got) != len(want):
            return f"in-place returned {type(got).__name__}, stock {type(want).__name__}"
        names = ("output", "lse") + tuple(f"result[{i}]" for i in range(2, len(want)))
        for name, a, b in zip(names, got, want):
            detail = compare_tensor(name, a, b)
            if detail:
                return detail
        return None
    return compare_tensor("output", got, want)


# ---------------------------------------------------------------------------------------------
# the key as an operator reads it

def key_text(kwargs: Mapping[str, Any]) -> str:
    """The decode shape of a key: rows, heads, topk, extra topk and the caches' shapes."""
    q, k = kwargs["q"], kwargs["k_cache"]
    idx = kwargs.get("indices")
    extra, extra_idx = kwargs.get("extra_k_cache"), kwargs.get("extra_indices_in_kvcache")
    parts = [f"{q.shape[0]} rows", f"{q.shape[-2]} heads"]
    if idx is not None:
        parts.append(f"topk {idx.shape[-1]}")
    if extra_idx is not None:
        parts.append(f"extra topk {extra_idx.shape[-1]}")
    parts.append(f"k_cache {list(k.shape)}")
    if extra is not None:
        parts.append(f"extra_k_cache {list(extra.shape)}")
    return ", ".join(parts)


def fingerprint(serial: int, kwargs: Mapping[str, Any]) -> list[int]:
    """What every rank's check of one key has alike: its number on this rank and the decode
    shape (not the pool size, not data pointers)."""
    q, idx = kwargs["q"], kwargs.get("indices")
    extra_idx = kwargs.get("extra_indices_in_kvcache")
    return [serial, int(q.shape[0]), int(q.shape[-2]), -1 if idx is None else int(idx.shape[-1]),
            -1 if extra_idx is None else int(extra_idx.shape[-1])]


# ---------------------------------------------------------------------------------------------
# the TP agreement (the group and its all-reduce: adapter/tp_group.py)

def agree(differs: bool, refused: bool, fp: list[int], group, world: int,
          reduce=all_reduce_max) -> tuple[bool, bool, bool]:
    """(any rank differs, any rank refused, ranks out of step) over the group; with one rank,
    this rank's own. `fp`: fingerprint(); ranks whose fingerprints differ are checking different
    keys (out of step): the caller falls back."""
    if world <= 1 or group is None:
        return differs, refused, False
    out = reduce([int(differs), int(refused)] + fp + [-v for v in fp], group)
    n = len(fp)
    highs, lows = out[2:2 + n], [-v for v in out[2 + n:]]
    return bool(out[0]), bool(out[1]), highs != lows


# ---------------------------------------------------------------------------------------------
# test only: the planted one-byte error in the in-place read

def planted_kwargs(kwargs: Mapping[str, Any]) -> tuple[dict, Optional[str]]:
    """A copy of the call whose k_cache is a copy of the pool's storage (same offset, shape and
    strides: the same page view) with one byte changed: in the page's scale footer, the UE8M0
    exponent of the first 64-wide nope tile of the first token that the first row with a
    candidate attends (its first index >= 0 within its topk_length), raised by 32 (capped at
    0xFE; 0xFF is NaN). That tile of that token's K and V is then 2^32 times too large: whatever
    its attention weight, the row's output moves (a flipped bit of a data byte can hide behind a
    softmax that gives the token no weight). The engine's pool is not written.
    Returns (kwargs, where); (a copy of kwargs, None) when no row attends a token."""
    import torch

    from adapter.swan.layout import DATA_BYTES, PAGE_TOKENS, SCALE_BYTES

    k = kwargs["k_cache"]
    idx = kwargs["indices"].reshape(kwargs["indices"].shape[0], -1)
    lengths = kwargs.get("topk_length")
    token = None
    for row in range(idx.shape[0]):
        width = idx.shape[1] if lengths is None else min(int(lengths[row]), idx.shape[1])
        valid = idx[row, :width]
        valid = valid[valid >= 0]
        if valid.numel():
            token = int(valid[0])
            break
    if token is None:
        return dict(kwargs), None
    storage = k.untyped_storage().clone()
    copy = torch.empty(0, dtype=k.dtype, device=k.device).set_(storage, k.storage_offset(),
                                                                k.shape, k.stride())
    flat = torch.empty(0, dtype=torch.uint8, device=k.device).set_(storage, 0, (storage.nbytes(),), (1,))
    page, slot = divmod(token, PAGE_TOKENS)
    size = k.element_size()
    at = (k.storage_offset() + page * k.stride(0)) * size + PAGE_TOKENS * DATA_BYTES + slot * SCALE_BYTES
    old = int(flat[at])
    flat[at] = min(old + PLANT_SCALE_UP, 0xFE)
    return (dict(kwargs, k_cache=copy),
            f"token {token} (page {page}, slot {slot}): its tile-0 scale byte {at} 0x{old:02x} -> "
            f"0x{int(flat[at]):02x}")
