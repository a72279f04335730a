"""swan (DSV41_SWA_NATIVE_DECODE=1): SM12x sparse decode reads the 256-token SWA pages in place.

The stock engine (sglang/kernels/ops/attention/flash_mla_sm120.py) copies every touched 256-token
SWA page into four 64-token pages (`_split_kv_pages_to_64`: mask memset, page mark, masked split)
before FlashInfer's sparse DSV4 decode. This adapter wraps the engine's SM12x decode entry
`flash_mla_with_kvcache_sm120` and sends each call the swan256 module can serve (runtime/swan256,
built ahead of time by scripts/build_swan.sh) to that module, which reads the pool through the 4-D
view [N, 256, 1, 584] with stride(0) = 149,760 B. Every other call goes to the stock function
unchanged (so it keeps the split), with one log line per distinct reason.

Layers:
  * verify_module(): manifest + sha256 of the .so + pinned FlashInfer version (install refuses
    on any mismatch or a missing module);
  * describe_call() / route(): a pure function of the call's tensor metadata (shapes, strides,
    dtypes, device) and the module's capabilities -> None (serve) or a fallback reason;
  * Kernel: the thin layer that loads the .so (tvm-ffi), asks FlashInfer's own planner for the
    tactic the stock call would get at 64-token pages, checks that the module resolves the same
    plan at 256-token pages (tactic_reason()), and launches.
Only the Kernel touches a GPU; everything above it is tested on CPU.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import sys
from typing import Any, Mapping, Optional

from adapter import receipts

NAME = "swan"
KEY = "DSV41_SWA_NATIVE_DECODE"
ENGINE_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
ENTRY = "flash_mla_with_kvcache_sm120"

MODULE_TAG = "swan256"
MANIFEST_SCHEMA = 1
PAGE_TOKENS = 256
ROW_BYTES = 584                 # 448 fp8 nope + 64 bf16 rope (576) + 8 scale bytes
DATA_BYTES = 576
SCALE_BYTES = 8
PAGE_STRIDE = (PAGE_TOKENS * ROW_BYTES + DATA_BYTES - 1) // DATA_BYTES * DATA_BYTES  # 149,760
SPLIT_PAGE_TOKENS = 64          # what the stock split produces
SPLIT_PAGE_STRIDE = (SPLIT_PAGE_TOKENS * ROW_BYTES + DATA_BYTES - 1) // DATA_BYTES * DATA_BYTES
D_QK = 512
D_V = 512
DECODE_MAX_TOKENS = 64
MAX_HEADS = 128
FLASHINFER_HEAD_SPECIALISATIONS = (8, 16, 32, 64, 128)   # others run the runtime-head kernel (0)
SUPPORTED_ARCHS = {(12, 0): "sm_120a", (12, 1): "sm_121a"}

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODULE_DIR = REPO_ROOT / "runtime" / "build" / MODULE_TAG
# Where the built module lives. Not a DSV41_ key: an image-layout override, also the test seam
# for "module not built" without touching the real build.
MODULE_DIR_ENV = "SWAN_RUNTIME_DIR"

assert PAGE_STRIDE == 149_760 and SPLIT_PAGE_STRIDE == 37_440


class ModuleError(Exception):
    """The swan256 module is missing, tampered with, or was built for other bits."""


# ---------------------------------------------------------------------------------------------
# module verification (install time)

@dataclasses.dataclass(frozen=True)
class ModuleInfo:
    directory: pathlib.Path
    so_path: pathlib.Path
    sha256: str
    flashinfer_version: str
    archs: tuple[str, ...]
    heads: tuple[int, ...]
    manifest: Mapping[str, Any]


def module_dir(environ: Optional[Mapping[str, str]] = None) -> pathlib.Path:
    env = os.environ if environ is None else environ
    return pathlib.Path(env[MODULE_DIR_ENV]) if env.get(MODULE_DIR_ENV) else DEFAULT_MODULE_DIR


def sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def installed_flashinfer_version() -> Optional[str]:
    """The installed flashinfer-python version, from its metadata (importing flashinfer itself
    needs its GPU stack)."""
    from importlib import metadata

    try:
        return metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        return None


def verify_module(directory: pathlib.Path, flashinfer_version: Optional[str]) -> ModuleInfo:
    """Check the built module against its manifest; raise ModuleError saying what is wrong."""
    manifest_path = directory / "manifest.json"
    if not manifest_path.exists():
        raise ModuleError(f"the {MODULE_TAG} module is not built ({manifest_path} is missing; "
                          "scripts/build_swan.sh builds it where nvcc is present)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        raise ModuleError(f"{manifest_path} is unreadable: {exc}") from None
    if manifest.get("schema") != MANIFEST_SCHEMA or manifest.get("module_tag") != MODULE_TAG:
        raise ModuleError(f"{manifest_path} is not a {MODULE_TAG} manifest of schema "
                          f"{MANIFEST_SCHEMA} (module_tag={manifest.get('module_tag')!r}, "
                          f"schema={manifest.get('schema')!r})")
    so_path = directory / str(manifest.get("so", f"{MODULE_TAG}.so"))
    if not so_path.exists():
        raise ModuleError(f"the {MODULE_TAG} module {so_path} is missing (manifest present)")
    found = sha256_file(so_path)
    if found != manifest.get("sha256"):
        raise ModuleError(f"sha256 of {so_path} is {found}, the build manifest records "
                          f"{manifest.get('sha256')}: the module is not the one that was built")
    if manifest.get("page_tokens") != PAGE_TOKENS or manifest.get("page_stride_bytes") != PAGE_STRIDE:
        raise ModuleError(f"{so_path} serves pages of {manifest.get('page_tokens')} tokens / "
                          f"{manifest.get('page_stride_bytes')} B, not {PAGE_TOKENS} / {PAGE_STRIDE}")
    if flashinfer_version != manifest.get("flashinfer_version"):
        raise ModuleError(f"{so_path} was built against FlashInfer "
                          f"{manifest.get('flashinfer_version')}, the installed one is "
                          f"{flashinfer_version}: rebuild it (scripts/build_swan.sh)")
    return ModuleInfo(directory, so_path, found, str(manifest["flashinfer_version"]),
                      tuple(manifest.get("archs", ())), tuple(int(h) for h in manifest.get("heads", ())),
                      manifest)


# ---------------------------------------------------------------------------------------------
# routing: a pure function of tensor metadata

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


@dataclasses.dataclass(frozen=True)
class ModuleCaps:
    heads: tuple[int, ...] = (8, 16, 32, 64, 128, 0)
    archs: tuple[str, ...] = ("sm_120a", "sm_121a")


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
    if f.positional:
        return "positional call (the engine passes keywords only)"
    if f.backend != "flashinfer":
        return f"engine SM120 backend is {f.backend!r}: it does not split pages"
    q = f.q
    if q is None or f.k_cache is None:
        return "q or k_cache missing"
    rows = q.shape[0] if q.shape else 0
    if rows > DECODE_MAX_TOKENS:
        return f"more than {DECODE_MAX_TOKENS} query rows (engine prefill path)"
    if rows == 0:
        return "empty call"
    if q.device != "cuda":
        return f"tensors on {q.device}, not CUDA"
    if f.capability not in SUPPORTED_ARCHS or SUPPORTED_ARCHS[f.capability] not in caps.archs:
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
    tensors = [getattr(f, field.name) for field in dataclasses.fields(f)]
    if any(isinstance(t, TensorFacts) and t.device != "cuda" for t in tensors):
        return "call mixes CUDA and non-CUDA tensors"
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
# tactic: same plan as the stock call (pure comparison; the inputs come from the Kernel layer)

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


# ---------------------------------------------------------------------------------------------
# the thin kernel layer (GPU only)

@dataclasses.dataclass(frozen=True)
class Plan:
    reason: Optional[str]
    facts: Optional[Mapping[str, int]] = None


class Kernel:
    """Loads the verified .so and runs it. Created on the first call that routing serves."""

    def __init__(self, info: ModuleInfo):
        import tvm_ffi

        self.info = info
        self.mod = tvm_ffi.load_module(str(info.so_path))
        facts = dict(self.mod.swan256_info())
        expected = {"module_tag": MODULE_TAG, "page_tokens": PAGE_TOKENS,
                    "page_stride_bytes": PAGE_STRIDE, "row_bytes": ROW_BYTES,
                    "flashinfer_version": info.flashinfer_version}
        for key, value in expected.items():
            if facts.get(key) != value:
                raise ModuleError(f"{info.so_path} reports {key}={facts.get(key)!r}, expected {value!r}")
        self.heads = tuple(int(h) for h in facts["heads"])
        self._plans: dict[tuple, Plan] = {}

    @staticmethod
    def _shape_key(f: CallFacts) -> tuple:
        return dataclasses.astuple(f)

    def plan(self, f: CallFacts, kwargs: Mapping[str, Any]) -> Plan:
        key = self._shape_key(f)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._resolve(f, kwargs)
        return plan

    def _resolve(self, f: CallFacts, kwargs: Mapping[str, Any]) -> Plan:
        import torch
        from flashinfer.mla._sparse_mla_sm120 import _calibration, _prepared
        from flashinfer.mla._sparse_mla_sm120._execution import AttentionMetadata

        q, idx = f.q, f.indices
        rows, heads, topk = q.shape[0], q.shape[-2], idx.shape[-1]
        extra = f.extra_k_cache
        if extra is not None:
            axis = 2 if len(extra.shape) == 4 and extra.shape[1] == 1 else 1
            extra_topk, extra_pbs, extra_stride = f.extra_indices.shape[-1], extra.shape[axis], extra.stride[0]
            extra_idx_stride = f.extra_indices.stride[0]
        else:
            extra_topk = extra_pbs = extra_stride = extra_idx_stride = 0
        common = dict(model=1, tokens=rows, heads=heads, topk=topk, extra_topk=extra_topk,
                      extra_page_size=extra_pbs, extra_page_stride_bytes=extra_stride,
                      row_stride_bytes=ROW_BYTES, indices_stride=idx.stride[0],
                      extra_indices_stride=extra_idx_stride, lse_stride=heads,
                      has_lengths=f.topk_length is not None,
                      has_extra_lengths=f.extra_topk_length is not None,
                      has_sink=f.attn_sink is not None, extra_fp4=False, variant=0)
        # The tactic the stock call gets: FlashInfer's own planner on the split (64-token) view.
        stock_meta = AttentionMetadata(page_size=SPLIT_PAGE_TOKENS,
                                       page_stride_bytes=SPLIT_PAGE_STRIDE, **common)
        device = kwargs["q"].device
        # As the stock functional path does: refresh calibration outside graph capture.
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            _calibration.refresh_store()
        try:
            stock_plan = _prepared.resolve_execution(stock_meta, device, "default", False, 0)
        except ValueError as exc:
            return Plan(f"FlashInfer's planner refuses this shape ({exc})")
        stock = dict(stock_plan.inspect())
        if stock.get("variant", 0) != 0 or stock.get("implementation") != "ordinary":
            return Plan(tactic_reason(stock, None))
        sm_count, max_shared = _prepared.device_caps(device)
        try:
            values = self.mod.swan256_plan(rows, heads, topk, extra_topk, extra_pbs, extra_stride,
                                           idx.stride[0], extra_idx_stride, heads,
                                           common["has_lengths"], common["has_extra_lengths"],
                                           common["has_sink"], int(stock["cpb"]), sm_count, max_shared)
        except Exception as exc:  # tvm-ffi raises its own error types
            return Plan(f"module cannot plan this shape ({type(exc).__name__})")
        ours = dict(zip(PLAN_FIELDS, (int(v) for v in values)))
        return Plan(tactic_reason(stock, ours), ours)

    def run(self, plan: Plan, kwargs: Mapping[str, Any]):
        import torch

        q = kwargs["q"]
        q3 = q.squeeze(1) if q.ndim == 4 else q
        rows, heads, _ = q3.shape
        k_cache = kwargs["k_cache"]
        kv = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
        idx = kwargs["indices"]
        idx = idx.squeeze(1) if idx.dim() == 3 else idx
        extra = kwargs.get("extra_k_cache")
        if extra is not None and extra.dtype != torch.uint8:
            extra = extra.view(torch.uint8)
        extra_idx = kwargs.get("extra_indices_in_kvcache")
        if extra_idx is not None and extra_idx.dim() == 3:
            extra_idx = extra_idx.squeeze(1)
        scale = kwargs.get("softmax_scale")
        if scale is None:
            scale = q.shape[-1] ** (-0.5)
        dev = q.device
        output = torch.empty(rows, heads, D_V, dtype=torch.bfloat16, device=dev)
        out_lse = torch.empty(rows, heads, dtype=torch.float32, device=dev)
        mid_out = torch.empty(plan.facts["partial_bytes"] // 2, dtype=torch.bfloat16, device=dev)
        mid_lse = torch.empty(plan.facts["lse_bytes"] // 4, dtype=torch.float32, device=dev)
        self.mod.swan256_decode(q3, kv, idx, mid_out, mid_lse, output, out_lse, plan.facts["cpb"],
                                float(scale), kwargs.get("topk_length"), kwargs.get("attn_sink"),
                                extra, extra_idx, kwargs.get("extra_topk_length"))
        return (output.unsqueeze(1), None)   # what the stock entry returns


# ---------------------------------------------------------------------------------------------
# install

class _Router:
    def __init__(self, ctx, info: ModuleInfo, kernel: Optional[Kernel]):
        self.ctx = ctx
        self.info = info
        self.kernel = kernel
        self.load_error: Optional[str] = None
        self.caps = ModuleCaps(heads=info.heads, archs=info.archs)
        self.first_served = False

    def backend(self) -> str:
        return str(getattr(sys.modules[ENGINE_MODULE], "_sm120_default_backend", "unknown"))

    def _kernel(self) -> Optional[Kernel]:
        if self.kernel is None and self.load_error is None:
            try:
                self.kernel = Kernel(self.info)
            except Exception as exc:
                self.load_error = f"module failed to load: {type(exc).__name__}: {exc}"
        return self.kernel

    def __call__(self, original, *args, **kwargs):
        facts = describe_call(args, kwargs, self.backend())
        reason = route(facts, self.caps)
        plan = None
        if reason is None:
            kernel = self._kernel()
            if kernel is None:
                reason = self.load_error
            else:
                plan = kernel.plan(facts, kwargs)
                reason = plan.reason
        if reason is not None:
            self.ctx.fallback(reason)
            return original(*args, **kwargs)
        self.ctx.counters["served"] += 1
        if not self.first_served:
            self.first_served = True
            q = facts.q
            receipts.line(NAME, "first in-place decode: %d rows, %d heads, topk %d, cpb %d",
                          q.shape[0], q.shape[-2], facts.indices.shape[-1], plan.facts["cpb"])
        return self.kernel.run(plan, kwargs)


ROUTER: Optional[_Router] = None     # the installed router of this process (introspection)


def install(ctx) -> str:
    from adapter.installer import Refusal

    try:
        info = verify_module(module_dir(), installed_flashinfer_version())
    except ModuleError as exc:
        raise Refusal(str(exc)) from None
    kernel = None
    load = "deferred to the first CUDA call"
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    if cuda:
        try:
            kernel = Kernel(info)
        except Exception as exc:
            raise Refusal(f"{info.so_path} failed to load: {type(exc).__name__}: {exc}") from None
        load = "loaded"
    global ROUTER
    router = ROUTER = _Router(ctx, info, kernel)
    ctx.around(ENTRY, router)
    return (f"{KEY}={ctx.value(KEY)}: decode calls of <= {DECODE_MAX_TOKENS} rows read the "
            f"{PAGE_TOKENS}-token SWA pages in place ([N,{PAGE_TOKENS},1,{ROW_BYTES}], stride(0)="
            f"{PAGE_STRIDE}) via {info.so_path.name} sha256 {info.sha256[:16]} (FlashInfer "
            f"{info.flashinfer_version}, {'/'.join(info.archs)}, heads {','.join(map(str, info.heads))}); "
            f"kernel {load}; engine SM120 backend {router.backend()}; other calls keep the stock split")
