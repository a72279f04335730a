"""swan kernel layer against the real built .so, on CPU.

The .so loads without a GPU (libcudart from the toolkit on LD_LIBRARY_PATH; nothing touches the
driver until a launch), and its host-side code runs: `swan256_info`, `swan256_plan` (FlashInfer's
own `resolve_attention`, compiled into the module) and the argument checks of `swan256_decode`.
So this checks, on the real binary:
  * the plan the module resolves at 256-token pages equals the plan FlashInfer's resolver gives
    the stock call at 64-token pages, field by field, across decode shapes (the tactic does not
    depend on the page size);
  * the adapter's Kernel layer sends the stock-equivalent metadata (64-token pages, 37,440 B
    stride) to FlashInfer's planner and the stock chunking to the module, and falls back when
    the planner picks a prefill variant;
  * Kernel.run's call matches the binding's 14-argument ABI (it gets as far as the CUDA check).
FlashInfer's Python planner cannot be imported here (its package needs pynvml and a GPU): the
child stands in `_prepared.resolve_execution` by a call to the real C++ resolver in the .so with
a given chunking, and takes AttentionMetadata's field list from FlashInfer's installed source.
"""
import json
import pathlib

import pytest

from adapter import swan
from conftest import run_python

MANIFEST = swan.module_dir() / "manifest.json"


def _cudart_dir():
    if not MANIFEST.exists():
        return None
    home = pathlib.Path(json.loads(MANIFEST.read_text()).get("cuda_home", "/usr/local/cuda"))
    for d in (home / "lib64", home / "lib", *home.glob("targets/*/lib")):
        if any(d.glob("libcudart.so*")):
            return d
    return None


pytestmark = pytest.mark.skipif(
    _cudart_dir() is None,
    reason="swan256 module not built here, or no libcudart to load it (test_swan_build fails "
           "where a CUDA toolkit exists and the module is missing)")

CHILD = r"""
import ast, collections, json, math, sys, types, pathlib
import torch
from adapter import swan

# --- FlashInfer's Python planner, stood in (see the test module docstring) -----------------
fi_exec_src = pathlib.Path(sys.prefix, "lib/python3.11/site-packages/flashinfer/mla/_sparse_mla_sm120/_execution.py")
tree = ast.parse(fi_exec_src.read_text())
cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AttentionMetadata")
fields = [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)]
AttentionMetadata = collections.namedtuple("AttentionMetadata", fields)

info = swan.verify_module(swan.module_dir(), swan.installed_flashinfer_version())
kernel = swan.Kernel(info)                       # real load + swan256_info check
mod = kernel.mod
POLICY = {"cpb": 0, "variant": 0}
seen = []

def resolve_execution(m, device, precision, is_nvfp4, preference, decode_only=False):
    assert precision == "default" and is_nvfp4 is False and preference == 0
    seen.append(m)
    return mod.resolve_attention(list(m._replace(variant=POLICY["variant"])), 1, POLICY["cpb"], 48, 101376)

pkg = {
    "flashinfer": {}, "flashinfer.mla": {}, "flashinfer.mla._sparse_mla_sm120": {},
    "flashinfer.mla._sparse_mla_sm120._calibration": {"refresh_store": lambda: None},
    "flashinfer.mla._sparse_mla_sm120._prepared": {"resolve_execution": resolve_execution,
                                                   "device_caps": lambda device: (48, 101376)},
    "flashinfer.mla._sparse_mla_sm120._execution": {"AttentionMetadata": AttentionMetadata},
}
for name, attrs in pkg.items():
    m = types.ModuleType(name); m.__path__ = []; m.__dict__.update(attrs); sys.modules[name] = m
fi = sys.modules["flashinfer.mla._sparse_mla_sm120"]
for sub in ("_calibration", "_prepared", "_execution"):
    setattr(fi, sub, sys.modules["flashinfer.mla._sparse_mla_sm120." + sub])

def call(rows, heads, topk, extra_topk):
    raw = torch.zeros(3 * swan.PAGE_STRIDE, dtype=torch.uint8)
    kw = dict(q=torch.zeros(rows, 1, heads, 512, dtype=torch.bfloat16),
              k_cache=raw.as_strided((3, 256, 1, 584), (swan.PAGE_STRIDE, 584, 584, 1)),
              head_dim_v=512, softmax_scale=0.0625,
              indices=torch.full((rows, 1, topk), -1, dtype=torch.int32),
              topk_length=torch.full((rows,), topk, dtype=torch.int32),
              attn_sink=torch.zeros(heads), extra_k_cache=None,
              extra_indices_in_kvcache=None, extra_topk_length=None)
    if extra_topk:
        e = torch.zeros(4 * swan.SPLIT_PAGE_STRIDE, dtype=torch.uint8)
        kw.update(extra_k_cache=e.as_strided((4, 64, 1, 584), (swan.SPLIT_PAGE_STRIDE, 584, 584, 1)),
                  extra_indices_in_kvcache=torch.full((rows, 1, extra_topk), -1, dtype=torch.int32),
                  extra_topk_length=torch.full((rows,), extra_topk, dtype=torch.int32))
    return kw

out = {"shapes": [], "info": {k: (list(v) if not isinstance(v, (int, str)) else v)
                              for k, v in dict(mod.swan256_info()).items()}}
for rows in (1, 4, 64):
    for heads in (8, 12, 16, 64, 128):
        for topk, extra in ((128, 0), (128, 512), (512, 64)):
            for cpb in (0, 2):
                POLICY.update(cpb=cpb, variant=0)
                kernel._plans.clear(); seen.clear()
                kw = call(rows, heads, topk, extra)
                facts = swan.describe_call((), kw, "flashinfer")
                plan = kernel.plan(facts, kw)
                stock = dict(mod.resolve_attention(list(seen[0]), 1, cpb, 48, 101376).inspect())
                ours = plan.facts or {}
                chunks = math.ceil(topk / 64) + math.ceil(extra / 64)
                out["shapes"].append(dict(
                    rows=rows, heads=heads, topk=topk, extra=extra, cpb_req=cpb,
                    reason=plan.reason,
                    stock_page=(seen[0].page_size, seen[0].page_stride_bytes),
                    stock_fields_match={k: getattr(seen[0], k) == v for k, v in dict(
                        tokens=rows, heads=heads, topk=topk, extra_topk=extra,
                        extra_page_size=64 if extra else 0, row_stride_bytes=584,
                        has_sink=True, has_lengths=True, has_extra_lengths=bool(extra),
                        lse_stride=heads, indices_stride=topk).items()},
                    same_plan=all(int(ours.get(f, -1)) == int(stock[f]) for f in swan.COMPARED_FIELDS),
                    chunks_ok=ours.get("chunk_capacity") == chunks,
                    cpb_ok=(ours.get("cpb") == cpb) if cpb else True,
                    heads_ok=ours.get("specialized_heads") == swan.kernel_heads(heads)))

# a planner that picks a prefill variant for a decode shape -> stock split keeps the call
POLICY.update(cpb=0, variant=2); kernel._plans.clear()
kw = call(4, 64, 128, 0)
out["prefill_reason"] = kernel.plan(swan.describe_call((), kw, "flashinfer"), kw).reason

# Kernel.run reaches the binding's first device check: the 14-argument ABI matches
POLICY.update(cpb=0, variant=0); kernel._plans.clear()
kw = call(4, 16, 128, 512)
plan = kernel.plan(swan.describe_call((), kw, "flashinfer"), kw)
try:
    kernel.run(plan, kw); out["run_error"] = None
except Exception as exc:
    out["run_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[-1]}"
try:
    mod.swan256_decode(kw["q"]); out["arity_error"] = None
except Exception as exc:
    out["arity_error"] = type(exc).__name__ + ": " + str(exc).splitlines()[-1]
try:
    mod.swan256_plan(65, 16, 128, 0, 0, 0, 128, 0, 16, True, False, True, 0, 48, 101376)
    out["rows65"] = None
except Exception as exc:
    out["rows65"] = str(exc).splitlines()[-1]
print("REPORT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def report():
    proc = run_python(CHILD, env={"LD_LIBRARY_PATH": str(_cudart_dir())}, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_module_reports_its_fixed_geometry(report):
    info = report["info"]
    assert (info["page_tokens"], info["page_stride_bytes"], info["row_bytes"]) == (256, 149760, 584)
    assert info["module_tag"] == "swan256" and info["flashinfer_version"] == "0.7.2"
    assert info["heads"] == [8, 16, 32, 64, 128, 0]


def test_module_plan_at_256_equals_flashinfer_plan_for_the_stock_call(report):
    assert len(report["shapes"]) == 90
    for shape in report["shapes"]:
        assert shape["reason"] is None, shape
        assert shape["stock_page"] == [64, 37440], shape
        assert all(shape["stock_fields_match"].values()), shape
        assert shape["same_plan"] and shape["chunks_ok"] and shape["cpb_ok"] and shape["heads_ok"], shape


def test_prefill_variant_keeps_the_stock_split(report):
    assert report["prefill_reason"].startswith("FlashInfer's planner picks prefill variant 2")


def test_run_matches_the_binding_abi(report):
    assert report["run_error"] == "RuntimeError: Check failed: kv.device().device_type == kDLCUDA (1 vs. 2) : kv must be a CUDA tensor"
    assert report["arity_error"] and "kv must be a CUDA tensor" not in report["arity_error"]
    assert "serves 1..64 query rows; got 65" in report["rows65"]
