"""swan's CPU twin: the router's kernel in a process without CUDA.

Same interface as the GPU layer (kernel.Kernel: plan(facts, kwargs) -> Plan, run(plan, kwargs) ->
what the stock entry returns). A routed decode call is served by the engine's own torch sparse
decode (`flash_mla_sm120._sm120_sparse_decode_fwd`, what the engine's `torch` SM120 backend runs)
reading the pool in place through swan's page view [N, 256, 1, 584], stride(0) = 149,760 B: no
mask, no mark, no split, no split buffer, as with the module. Its caps are the module's (head
kernels, the same layout checks in routing.route) on the CPU device; the compute capability check
has no meaning there and is skipped.

What it is for: the router, the decision cache, the page view, the counters and the receipts run
in a real server on CPU (tests/e2e/test_e2e_dsv4_swan.py), and a served call's answer can be
compared with the stock split route's. What it is not: the swan256 module's kernel. Its bits are
the engine's torch decode's, not FlashInfer's tensor-core kernel's at 256-token pages; the plan
equality with FlashInfer's planner (kernel.Kernel.plan) does not run here.
"""
from __future__ import annotations

import sys
from typing import Any, Mapping

from adapter.swan.layout import PAGE_STRIDE, PAGE_TOKENS, ROW_BYTES
from adapter.swan.kernel import Plan
from adapter.swan.module import ModuleInfo
from adapter.swan.routing import CallFacts, ModuleCaps

ENGINE_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
ENGINE_DECODE = "_sm120_sparse_decode_fwd"
NAME = "CPU twin"
DETAIL = (f"{NAME} (no CUDA in this process: the engine's torch sparse decode {ENGINE_DECODE} reads "
          "the 256-token pages in place, swan256.so is not run)")


class Twin:
    """The CPU twin of the swan256 module (see the module docstring)."""

    NAME = NAME
    DETAIL = DETAIL

    def __init__(self, info: ModuleInfo):
        self.info = info
        self.caps = ModuleCaps(heads=info.heads, archs=info.archs, device="cpu")
        self._plan = Plan(None, {})

    def plan(self, facts: CallFacts, kwargs: Mapping[str, Any]) -> Plan:
        """Every call routing serves has the same plan: the torch decode has no tactic."""
        return self._plan

    def run(self, plan: Plan, kwargs: Mapping[str, Any]):
        import torch

        decode = getattr(sys.modules[ENGINE_MODULE], ENGINE_DECODE)
        q = kwargs["q"]
        k_cache = kwargs["k_cache"]
        # The pool in place, through swan's view (routing checked it; a call that is not this
        # view raises here, before anything is written, and keeps the stock split).
        pages = k_cache.view(torch.uint8) if k_cache.dtype != torch.uint8 else k_cache
        if (tuple(pages.shape[1:]) != (PAGE_TOKENS, 1, ROW_BYTES) or pages.stride(0) != PAGE_STRIDE
                or pages.stride(1) != ROW_BYTES or pages.stride(3) != 1):
            raise ValueError(f"k_cache is not the page view [N,{PAGE_TOKENS},1,{ROW_BYTES}], "
                             f"stride(0)={PAGE_STRIDE}")
        q4 = q if q.dim() == 4 else q.unsqueeze(1)
        idx = kwargs["indices"]
        idx3 = idx if idx.dim() == 3 else idx.unsqueeze(1)
        extra = kwargs.get("extra_k_cache")
        extra_idx = kwargs.get("extra_indices_in_kvcache")
        if extra_idx is not None and extra_idx.dim() == 2:
            extra_idx = extra_idx.unsqueeze(1)
        scale = kwargs.get("softmax_scale")
        if scale is None:
            scale = q.shape[-1] ** (-0.5)
        out, _ = decode(q4, pages, idx3, kwargs.get("topk_length"), kwargs.get("attn_sink"),
                        kwargs["head_dim_v"], scale, extra, extra_idx, kwargs.get("extra_topk_length"))
        return (out, None)     # what the stock entry's flashinfer route returns: [T, 1, H, d_v], no LSE
