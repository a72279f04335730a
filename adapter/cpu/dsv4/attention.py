"""The engine's DeepSeek-V4 attention backend on CPU: the stand-ins its GB10 (SM120) route needs.

Tests, benches and CPU test servers only; nothing in production imports this module. The backend class, the pool,
the ForwardBatch, the metadata builders, the SWA page indices, the c4 indexer (logits + top-k)
and the sparse attention are the engine's own: `SGLANG_SM120_FLASHMLA_BACKEND=torch` selects the
pure-torch `_sm120_sparse_decode_fwd`, `SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1` the torch indexer
logits, `dsa_topk_backend=torch` the torch top-k. What cannot run here (Triton / CUDA-JIT) is
replaced below, one function each, with what production runs instead named in its docstring.
(`cpu_route()` is the in-process route of cone's harness; the CPU test server runs the engine's
production backend, flashinfer, with the stand-ins of flash_mla.py.)
"""
from __future__ import annotations

import contextlib

import torch

from adapter.cpu.dsv4.metadata import init_compression_metadata_torch  # noqa: F401 (cpu_route)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
NOPE, TILE = 448, 64          # V4 latent: 448 fp8 nope dims in 64-wide scale tiles, then 64 bf16 rope
INDEX_DIM = 128


def prepare() -> None:
    """The import stand-in the engine's DSV4 attention modules need on CPU (call first): the
    torchvision shim (no sgl_kernel stand-in is needed on this route)."""
    from adapter.cpu import cpu_engine

    cpu_engine.install_torchvision_shim()


def create_paged_compressor_data_stand_in(compress_ratio, **_):
    """Stand-in for compressor_v2.create_paged_compressor_data (production: the CUDA-JIT
    planner). Its plan is read only by the compressor kernels, which this route does not run
    (the harness writes latents and index keys itself at the engine's c4/c128 out locs)."""
    return None


def pack_k(k: torch.Tensor):
    """(fp8 nope, bf16 rope, ue8m0 scales) pack of bf16 rows [n, 512], the rule of the engine
    kit's `quant_to_nope_fp8_rope_bf16_pack_triton` in torch (production: the fused
    quantize-and-store kernels)."""
    from sglang.kernels.ops.kvcache.dsv4_main_kv_store import NopeFp8RopeBf16Pack

    k = k.to(torch.bfloat16)
    n = k.shape[0]
    tiles = k[:, :NOPE].float().view(n, NOPE // TILE, TILE)
    amax = tiles.abs().amax(-1).clamp_min(1e-8)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX))
    scaled = (tiles / torch.exp2(exponent)[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return NopeFp8RopeBf16Pack(
        k_nope_fp8=scaled.view(n, NOPE).to(FP8).contiguous(),
        k_rope_bf16=k[:, NOPE:].contiguous(),
        scale_k_nope_ue8m0=(exponent.to(torch.int32) + 127).to(torch.uint8).contiguous())


def store_k(buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Write bf16 rows [n, 512] at token slots `loc` of a V4-layout page buffer, with the engine
    kit's `set_k_and_s_torch` (production: `dsv4_main_kv_store.SetKAndS`, Triton)."""
    from sglang.test.kernels.deepseek_v4.k_cache_reference import set_k_and_s_torch

    if loc.numel():
        set_k_and_s_torch(buf, loc.to(torch.int64).contiguous(), pack_k(k), page_size)


def store_index_k(buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, page_size: int) -> None:
    """Write index keys [n, 128] (fp8 + one fp32 scale each) at slots `loc` of an index-K page
    buffer [pages, page_size * 132] (production: `dsa_index_k_cache.SetKAndS`, Triton)."""
    if not loc.numel():
        return
    k = k.float()
    scale = k.abs().amax(-1, keepdim=True).clamp_min(1e-4) / FP8_MAX      # the kernel floors amax at 1e-4
    data = (k / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
    loc = loc.to(torch.int64)
    page, slot = loc // page_size, loc % page_size
    cols = slot[:, None] * INDEX_DIM + torch.arange(INDEX_DIM)
    buf[page[:, None].expand_as(cols), cols] = data
    cols = page_size * INDEX_DIM + slot[:, None] * 4 + torch.arange(4)
    buf[page[:, None].expand_as(cols), cols] = scale.view(torch.uint8).view(-1, 4)


@contextlib.contextmanager
def cpu_route():
    """The GB10 dispatch (`is_sm120`), the torch attention and indexer-logits paths
    (SGLANG_SM120_FLASHMLA_BACKEND=torch, SGLANG_FP8_PAGED_MQA_LOGITS_TORCH=1, set in-process so
    the environment and other tests keep theirs), and the Triton / CUDA-JIT metadata pieces
    replaced; everything restored on exit."""
    from sglang.kernels.ops.attention import flash_mla_sm120
    from sglang.srt.environ import envs
    from sglang.srt.layers.attention import deepseek_v4_backend as backend_module
    from sglang.srt.runtime_context import override_platform

    patches = [(backend_module, "_init_compression_metadata_triton",
                init_compression_metadata_torch),
               (backend_module, "create_paged_compressor_data",
                create_paged_compressor_data_stand_in),
               # SGLANG_SM120_FLASHMLA_BACKEND, read once when the module imports.
               (flash_mla_sm120, "_sm120_default_backend", "torch")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with (override_platform(is_sm120=True),
              envs.SGLANG_FP8_PAGED_MQA_LOGITS_TORCH.override(True)):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def force_sm120(runtime_context) -> None:
    """Stand-in for the GB10 probe (production: the device reports compute capability 12.x):
    the process-wide platform says is_sm120 from now on, as `override_platform(is_sm120=True)`
    does for a scope. CPU servers only (adapter.cpu.dsv4.install)."""
    runtime_context.override_platform(is_sm120=True).install()
