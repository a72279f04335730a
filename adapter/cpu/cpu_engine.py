"""What the pinned engine needs to import and run on a CPU machine (tests, sims, CPU servers).

PyPI's torchvision is CUDA-linked and fails beside the CPU build of torch, yet engine modules on
the scheduler's import path import it at module level (configs/deepseek_ocr.py,
multimodal/internvl_utils.py, and transformers' image utilities behind them). The stand-in below
answers `import torchvision[.x.y]` with placeholder modules: every attribute is a placeholder
class that can be referenced, subclassed and read further, and that raises if anything tries to
*use* it (call it). Nothing the scheduler, the radix cache or the autotune helpers run calls into
torchvision, so a call reaching it is a bug worth seeing. Production images have the real
torchvision; nothing in production imports this module.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

SHIM_VERSION = "0.0.0+dsv41.cpu.shim"


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args, **kwargs):
        raise RuntimeError(f"torchvision stand-in: {cls.__qualname__} was called; the CPU "
                           "harness has no torchvision (see adapter/cpu/cpu_engine.py)")


def _placeholder(qualname: str) -> type:
    return _PlaceholderMeta(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname,
                                                             "__module__": "torchvision"})


class _StandInModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__path__ = []
        module.__version__ = SHIM_VERSION
        module.__dsv41_shim__ = True
        return module

    def exec_module(self, module):
        pass


def install_torchvision_shim() -> bool:
    """Install the stand-in unless a real torchvision is importable. Returns True if installed."""
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return True
    if "torchvision" not in sys.modules and importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.insert(0, _StandInFinder())
    return True


# --- sgl_kernel: the engine's CUDA/CPU kernel package, absent here ---------------------------

class _SglKernelStandIn(types.ModuleType):
    """Top-level `sgl_kernel` only. Every name is a function that raises when called.

    The CPU engine path imports it at module level (kernels/ops/kvcache/cache_move.py) but the
    server we run never calls it. Submodules are deliberately *not* answered: the engine's own
    `try: from sgl_kernel.x import y / except ImportError` fallbacks must keep working.
    """

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def _called(*args, **kwargs):
            raise RuntimeError(f"sgl_kernel stand-in: sgl_kernel.{name} was called; the CPU "
                               "harness has no sgl_kernel (see adapter/cpu/cpu_engine.py)")

        _called.__name__ = _called.__qualname__ = name
        setattr(self, name, _called)
        return _called


def install_sgl_kernel_stand_in() -> bool:
    """Put the stand-in in sys.modules unless a real sgl_kernel is importable. True if installed."""
    current = sys.modules.get("sgl_kernel")
    if current is not None:
        return isinstance(current, _SglKernelStandIn)
    if importlib.util.find_spec("sgl_kernel") is not None:
        return False
    module = _SglKernelStandIn("sgl_kernel")
    module.__version__ = SHIM_VERSION
    module.__dsv41_shim__ = True
    sys.modules["sgl_kernel"] = module
    return True


# --- The real hybrid-SWA radix cache on CPU -------------------------------------------------

import dataclasses  # noqa: E402


@dataclasses.dataclass
class CpuSwaCache:
    """The engine's own UnifiedRadixCache (FULL + SWA) with its real pools, on CPU."""

    cache: object                 # sglang UnifiedRadixCache
    allocator: object             # SWATokenToKVPoolAllocator
    kv_pool: object               # SWAKVPool
    req_to_token_pool: object     # ReqToTokenPool
    page_size: int
    window: int

    def alloc(self, n: int):
        """Full + SWA slots for n tokens, page aligned, as the engine's radix test kit does."""
        page = self.page_size
        aligned = -(-n // page) * page
        full = self.allocator.full_attn_allocator.alloc(aligned)
        swa = self.allocator.swa_attn_allocator.alloc(aligned)
        if full is None or swa is None:
            raise MemoryError(f"out of KV slots for {aligned} tokens")
        # index_copy_, not index assignment: ~10x faster into a multi-million-entry map.
        mapping = self.allocator.full_to_swa_index_mapping
        mapping.index_copy_(0, full, swa.to(mapping.dtype))
        return full[:n]


def build_swa_cache(*, full_tokens: int, swa_tokens: int, page_size: int = 256,
                    window: int = 128, backend: str = "python", req_slots: int = 16,
                    max_context_len: int | None = None, chunked_prefill_size: int | None = None,
                    attention_backend: str = "dsv4", server_args: dict | None = None,
                    **cache_params) -> CpuSwaCache:
    """Build UnifiedRadixCache(FULL, SWA) with ReqToTokenPool, SWAKVPool, SWATokenToKVPoolAllocator.

    KV buffers are one head of one element per layer (one SWA layer, one full layer): the tree,
    the allocators and eviction are the engine's; only the tensors are tiny. The published server
    arguments name `attention_backend` (default dsv4: the cluster's DeepSeek-V4 backend, which
    cone replay checks for before it plans), plus `server_args` (more ServerArgs fields, e.g. the
    engine's SWA bounded replay flags, published the same way).
    """
    install_torchvision_shim()
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page_size,
                                                    attention_backend=attention_backend,
                                                    **(server_args or {})))
    req_to_token_pool = ReqToTokenPool(size=req_slots, max_context_len=max_context_len or full_tokens,
                                       device="cpu", enable_memory_saver=False)
    kv_pool = SWAKVPool(size=full_tokens, size_swa=swa_tokens, page_size=page_size,
                        dtype=torch.bfloat16, head_num=1, head_dim=1,
                        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    allocator = SWATokenToKVPoolAllocator(size=full_tokens, size_swa=swa_tokens, page_size=page_size,
                                          dtype=torch.bfloat16, device="cpu", kvcache=kv_pool,
                                          need_sort=False)
    params = CacheInitParams(disable=False, req_to_token_pool=req_to_token_pool,
                             token_to_kv_pool_allocator=allocator, page_size=page_size,
                             sliding_window_size=window, chunked_prefill_size=chunked_prefill_size,
                             tree_components=(ComponentType.FULL, ComponentType.SWA),
                             tree_core_backend=backend, **cache_params)
    cache = UnifiedRadixCache(params)
    return CpuSwaCache(cache, allocator, kv_pool, req_to_token_pool, page_size, window)


# --- a drifted engine callable (tests of the refusal path in a real server) -----------------

def drift_callable(module, qualname: str) -> str:
    """Replace `qualname` of the imported engine `module` with a copy whose source differs by one
    statement (a docstring-like constant), as if the engine had changed it. Returns the new
    source's sha256. The CPU harness applies it from DSV41CPU_DRIFT=<module>:<qualname>."""
    import ast
    import inspect
    import tempfile
    import textwrap

    from adapter import pins

    owner = module
    *path, attr = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    func = pins.original_callable(raw)
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    tree.body[0].body.insert(0, ast.Expr(ast.Constant("drifted by the dsv41 CPU harness")))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write("from __future__ import annotations\n" + ast.unparse(tree) + "\n")
        path_name = fh.name
    namespace: dict = {}
    exec(compile(open(path_name).read(), path_name, "exec"), func.__globals__, namespace)
    setattr(owner, attr, namespace[attr])
    return pins.source_hash(namespace[attr])
