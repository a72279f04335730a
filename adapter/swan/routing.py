"""Routing: which decode calls the swan256 module serves, as pure functions of tensor metadata.

  * route(CallFacts, ModuleCaps) -> None (serve) or the fallback reason (stable text: each
    distinct reason is logged once);
  * tactic_reason(stock plan, module plan) -> None (same tactic) or the reason;
  * for the router's per-call path: entry_reason() (the checks that need only q's row count) and
    decode_key() (a flat, hashable key of exactly the metadata route() and the kernel's planner
    read), so that a decode call is described in full (describe_call) only the first time its key
    is seen.
Nothing here touches a GPU: everything is tested on CPU.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from adapter.swan.layout import (D_QK, D_V, DECODE_MAX_TOKENS, FLASHINFER_HEAD_SPECIALISATIONS,
                                 HEAD_KERNELS, MAX_HEADS, PAGE_STRIDE, PAGE_TOKENS, ROW_BYTES,
                                 SUPPORTED_ARCHS)


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str                  # torch dtype name without "torch."
    device: str                 # "cuda" | "cpu" | ...
    aligned16: bool             # data_ptr % 16 == 0
    contiguous: bool

    @classmethod
    def of(cls, t) -> Optional["TensorFacts"]:
        if t is None:
            return None
        return cls(tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", ""),
                   t.device.type, t.data_ptr() % 16 == 0, t.is_contiguous())


@dataclasses.dataclass(frozen=True)
class CallFacts:
    backend: str                                    # the engine's SM120 decode backend
    positional: bool                                # called with positional arguments
    capability: Optional[tuple[int, int]]           # of q's CUDA device
    q: Optional[TensorFacts]
    k_cache: Optional[TensorFacts]
    indices: Optional[TensorFacts]
    head_dim_v: Any
    topk_length: Optional[TensorFacts] = None
    attn_sink: Optional[TensorFacts] = None
    extra_k_cache: Optional[TensorFacts] = None
    extra_indices: Optional[TensorFacts] = None
    extra_topk_length: Optional[TensorFacts] = None


TENSOR_FIELDS = ("q", "k_cache", "indices", "topk_length", "attn_sink", "extra_k_cache",
                 "extra_indices", "extra_topk_length")


@dataclasses.dataclass(frozen=True)
class ModuleCaps:
    """What the router's kernel serves: head kernels, arches, and the device its tensors are on
    ("cuda": the swan256 module; "cpu": the CPU twin, adapter/swan/twin.py, whose device has no
    compute capability to check)."""
    heads: tuple[int, ...] = HEAD_KERNELS
    archs: tuple[str, ...] = ("sm_120a", "sm_121a")
    device: str = "cuda"


_capabilities: dict[int, tuple[int, int]] = {}


def _capability(device) -> Optional[tuple[int, int]]:
    if device.type != "cuda":
        return None
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capabilities:
        _capabilities[index] = tuple(torch.cuda.get_device_capability(index))
    return _capabilities[index]


def describe_call(args: tuple, kwargs: Mapping[str, Any], backend: str) -> CallFacts:
    q = kwargs.get("q")
    return CallFacts(
        backend=backend,
        positional=bool(args),
        capability=_capability(q.device) if q is not None else None,
        q=TensorFacts.of(q),
        k_cache=TensorFacts.of(kwargs.get("k_cache")),
        indices=TensorFacts.of(kwargs.get("indices")),
        head_dim_v=kwargs.get("head_dim_v"),
        topk_length=TensorFacts.of(kwargs.get("topk_length")),
        attn_sink=TensorFacts.of(kwargs.get("attn_sink")),
        extra_k_cache=TensorFacts.of(kwargs.get("extra_k_cache")),
        extra_indices=TensorFacts.of(kwargs.get("extra_indices_in_kvcache")),
        extra_topk_length=TensorFacts.of(kwargs.get("extra_topk_length")),
    )


def kernel_heads(heads: int) -> int:
    """FlashInfer's decode specialisation for a head count (0 = its runtime-head kernel)."""
    return heads if heads in FLASHINFER_HEAD_SPECIALISATIONS else 0


# ---------------------------------------------------------------------------------------------
# the router's per-call path

POSITIONAL_REASON = "positional call (the engine passes keywords only)"
MISSING_REASON = "q or k_cache missing"
PREFILL_REASON = f"more than {DECODE_MAX_TOKENS} query rows (engine prefill path)"
EMPTY_REASON = "empty call"


def entry_reason(positional: bool, backend: str, has_q_and_k: bool, rows: int) -> Optional[str]:
    """route()'s first checks, which need no tensor metadata but q's row count. The router runs
    them on every call: a call they refuse (prefill rows, another backend) is never keyed, so the
    decision cache holds decode shapes only (at most 64 row counts per layer shape)."""
    if positional:
        return POSITIONAL_REASON
    if backend != "flashinfer":
        return f"engine SM120 backend is {backend!r}: it does not split pages"
    if not has_q_and_k:
        return MISSING_REASON
    if rows > DECODE_MAX_TOKENS:
        return PREFILL_REASON
    if rows == 0:
        return EMPTY_REASON
    return None


def decode_key(q_shape, kwargs: Mapping[str, Any]) -> tuple:
    """Everything route() and the kernel's planner read of a call that passed entry_reason(), as
    one hashable tuple of torch's own objects (no description is built): two calls with equal
    keys get the same route() verdict and the same plan.

    Per tensor exactly what is read: q: shape, dtype, device (its index gives the capability),
    contiguity, 16-byte alignment; k_cache and extra_k_cache: shape, stride, dtype, device type,
    alignment; indices: shape, stride, dtype, device type; the [T]/[H] vectors: shape, dtype,
    contiguity, device type (route compares it with the kernel's device: CUDA for the module,
    CPU for the twin). Contiguity and alignment are what TensorFacts holds; a tensor's
    other bits (values, data pointer) never change a verdict. tests/test_swan_routing.py checks
    the key against route(describe_call(...)) over every served shape and fallback case."""
    q = kwargs["q"]
    k = kwargs["k_cache"]
    idx = kwargs.get("indices")
    topk_length = kwargs.get("topk_length")
    sink = kwargs.get("attn_sink")
    extra = kwargs.get("extra_k_cache")
    extra_idx = kwargs.get("extra_indices_in_kvcache")
    extra_len = kwargs.get("extra_topk_length")
    return (
        kwargs.get("head_dim_v"),
        q_shape, q.dtype, q.device, q.is_contiguous(), q.data_ptr() & 15,
        k.shape, k.stride(), k.dtype, k.device.type, k.data_ptr() & 15,
        None if idx is None else (idx.shape, idx.stride(), idx.dtype, idx.device.type),
        None if topk_length is None else (topk_length.shape, topk_length.dtype,
                                          topk_length.is_contiguous(), topk_length.device.type),
        None if sink is None else (sink.shape, sink.dtype, sink.is_contiguous(), sink.device.type),
        None if extra is None else (extra.shape, extra.stride(), extra.dtype, extra.device.type,
                                    extra.data_ptr() & 15),
        None if extra_idx is None else (extra_idx.shape, extra_idx.stride(), extra_idx.dtype,
                                        extra_idx.device.type),
        None if extra_len is None else (extra_len.shape, extra_len.dtype,
                                        extra_len.is_contiguous(), extra_len.device.type),
    )


# ---------------------------------------------------------------------------------------------
# route: a pure function of tensor metadata

def _vector_reason(name: str, t: Optional[TensorFacts], length: int, dtype: str) -> Optional[str]:
    if t is None:
        return None
    if t.dtype != dtype or len(t.shape) != 1 or t.shape[0] != length or not t.contiguous:
        return f"{name} is not a contiguous {dtype} vector of the call's length"
    return None


def _index_reason(name: str, t: Optional[TensorFacts], rows: int) -> Optional[str]:
    if t is None:
        return f"{name} missing"
    if t.dtype != "int32":
        return f"{name} dtype {t.dtype} (int32 only)"
    if not (len(t.shape) == 2 or (len(t.shape) == 3 and t.shape[1] == 1)) or t.shape[0] != rows:
        return f"{name} shape is not [T, K] or [T, 1, K]"
    width = t.shape[-1]
    if width <= 0 or width % 64 or t.stride[-1] != 1 or t.stride[0] < width:
        return f"{name} width not a positive multiple of 64 with a contiguous last dim"
    return None


def _extra_cache_reason(t: TensorFacts) -> Optional[str]:
    """The extra (compressed) cache passes through as in the stock path: it must be a layout
    FlashInfer's decode takes (tightly packed 584 B rows, singleton head axis, aligned)."""
    if t.dtype not in ("uint8", "float8_e4m3fn"):
        return f"extra_k_cache dtype {t.dtype}"
    if len(t.shape) == 3:
        rows, advance = t.shape[1], t.stride[1]
    elif len(t.shape) == 4 and (t.shape[1] == 1 or t.shape[2] == 1):
        axis = 2 if t.shape[1] == 1 else 1
        rows, advance = t.shape[axis], t.stride[axis]
    else:
        return "extra_k_cache is not a 3-D or singleton-head 4-D paged view"
    if (t.shape[-1] < ROW_BYTES or advance != ROW_BYTES or t.stride[-1] != 1 or rows <= 0
            or t.stride[0] % 16 or t.stride[0] < rows * ROW_BYTES or not t.aligned16):
        return "extra_k_cache layout is not packed 584-byte rows in 16-byte aligned pages"
    return None


def route(f: CallFacts, caps: ModuleCaps) -> Optional[str]:
    """None: the module serves this call in place. Otherwise the fallback reason (stable text:
    each distinct reason is logged once)."""
    q = f.q
    rows = (q.shape[0] if q.shape else 0) if q is not None else 0
    reason = entry_reason(f.positional, f.backend, q is not None and f.k_cache is not None, rows)
    if reason:
        return reason
    device = caps.device.upper()
    if q.device != caps.device:
        return f"tensors on {q.device}, not {device}"
    if caps.device == "cuda" and (f.capability not in SUPPORTED_ARCHS
                                  or SUPPORTED_ARCHS[f.capability] not in caps.archs):
        cap = f.capability or (0, 0)
        return f"device sm_{cap[0]}{cap[1]}: module built for {', '.join(caps.archs)}"
    if f.head_dim_v != D_V:
        return f"head_dim_v {f.head_dim_v} (the DSV4 decode has {D_V})"
    if q.dtype != "bfloat16":
        return f"q dtype {q.dtype} (bfloat16 only)"
    if not (len(q.shape) == 3 or (len(q.shape) == 4 and q.shape[1] == 1)) or q.shape[-1] != D_QK:
        return f"q shape is not [T, 1, H, {D_QK}] or [T, H, {D_QK}]"
    if not q.contiguous or not q.aligned16:
        return "q not contiguous and 16-byte aligned"
    heads = q.shape[-2]
    if not 0 < heads <= MAX_HEADS:
        return f"{heads} heads (decode serves 1..{MAX_HEADS})"
    if kernel_heads(heads) not in caps.heads:
        return f"{heads} heads: module built without the {kernel_heads(heads)}-head kernel"
    if any(t is not None and t.device != caps.device for t in (getattr(f, n) for n in TENSOR_FIELDS)):
        return f"call mixes {device} and non-{device} tensors"
    k = f.k_cache
    if k.dtype not in ("uint8", "float8_e4m3fn"):
        return f"k_cache dtype {k.dtype} (fp8/uint8 pages only)"
    if len(k.shape) != 4:
        return f"k_cache is {len(k.shape)}-D (the module takes the 4-D view [N, {PAGE_TOKENS}, 1, {ROW_BYTES}])"
    if k.shape[1:] != (PAGE_TOKENS, 1, ROW_BYTES):
        return f"k_cache pages are {list(k.shape[1:])}, not [{PAGE_TOKENS}, 1, {ROW_BYTES}]"
    if k.stride[0] != PAGE_STRIDE or k.stride[1] != ROW_BYTES or k.stride[3] != 1:
        return (f"k_cache strides {list(k.stride)} (needs stride(0)={PAGE_STRIDE}, "
                f"stride(1)={ROW_BYTES}, stride(3)=1)")
    if not k.aligned16:
        return "k_cache not 16-byte aligned"
    reason = _index_reason("indices", f.indices, rows)
    if reason:
        return reason
    reason = (_vector_reason("topk_length", f.topk_length, rows, "int32")
              or _vector_reason("attn_sink", f.attn_sink, heads, "float32"))
    if reason:
        return reason
    if (f.extra_k_cache is None) != (f.extra_indices is None):
        return "extra_k_cache and extra_indices not given together"
    if f.extra_k_cache is None:
        if f.extra_topk_length is not None:
            return "extra_topk_length without an extra cache"
        return None
    return (_extra_cache_reason(f.extra_k_cache)
            or _index_reason("extra_indices", f.extra_indices, rows)
            or _vector_reason("extra_topk_length", f.extra_topk_length, rows, "int32"))


# ---------------------------------------------------------------------------------------------
# tactic: same plan as the stock call (pure comparison; the inputs come from the kernel layer)

PLAN_FIELDS = ("cpb", "chunk_capacity", "active_splits", "scratch_split_stride", "scratch_heads",
               "head_blocks", "block_threads", "shared_bytes", "partial_bytes", "lse_bytes",
               "specialized_heads", "numeric", "implementation")
COMPARED_FIELDS = ("cpb", "active_splits", "scratch_split_stride", "scratch_heads",
                   "block_threads", "shared_bytes", "partial_bytes", "lse_bytes")


def tactic_reason(stock: Mapping[str, Any], ours: Optional[Mapping[str, Any]]) -> Optional[str]:
    """stock: FlashInfer's inspect() of the plan the stock call gets (64-token pages);
    ours: the module's plan at 256-token pages for the stock cpb. None = same tactic."""
    if int(stock.get("variant", -1)) != 0:
        return f"FlashInfer's planner picks prefill variant {stock.get('variant')} for this decode shape"
    if stock.get("implementation") != "ordinary" or stock.get("numeric_route") != "fp8":
        return (f"FlashInfer's plan is {stock.get('implementation')}/{stock.get('numeric_route')}"
                " (module serves ordinary/fp8)")
    if ours is None:
        return "module could not plan this shape"
    for field in COMPARED_FIELDS:
        if int(ours[field]) != int(stock[field]):
            return f"module plan differs from FlashInfer's in {field}"
    return None
