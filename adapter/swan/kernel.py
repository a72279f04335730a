"""The thin kernel layer (GPU only): loads the verified .so (tvm-ffi), asks FlashInfer's own
planner for the tactic the stock call would get at 64-token pages, checks that the module resolves
the same plan at 256-token pages (routing.tactic_reason), and launches. Created at install where
CUDA is present (without CUDA the router's kernel is the CPU twin, twin.py)."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from adapter.swan.layout import (D_V, MODULE_TAG, PAGE_STRIDE, PAGE_TOKENS, ROW_BYTES,
                                 SPLIT_PAGE_STRIDE, SPLIT_PAGE_TOKENS)
from adapter.swan.module import ModuleError, ModuleInfo
from adapter.swan.routing import PLAN_FIELDS, CallFacts, tactic_reason


@dataclasses.dataclass(frozen=True)
class Plan:
    reason: Optional[str]
    facts: Optional[Mapping[str, int]] = None


class Kernel:
    """Loads the verified .so and runs it. Created at install in a process with CUDA (without
    CUDA the router's kernel is the CPU twin, twin.Twin)."""

    NAME = MODULE_TAG + ".so"

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
        self._plans: dict[CallFacts, Plan] = {}

    def plan(self, f: CallFacts, kwargs: Mapping[str, Any]) -> Plan:
        """The plan for a call's facts, resolved once per facts (CallFacts is frozen and
        hashable: it is its own key)."""
        plan = self._plans.get(f)
        if plan is None:
            plan = self._plans[f] = self._resolve(f, kwargs)
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
