"""What swan's in-place decode removes per decode step: the engine's split chain.

The stock SM12x decode (sglang 0.5.23, kernels/ops/attention/flash_mla_sm120.py) runs, before
every sparse DSV4 decode call (one per layer, 43 per step), `_split_kv_pages_to_64`:
  1. mask.zero_()                       memset of one byte per SWA pool page
  2. _page_mark_kernel                  grid ceil(T * topk / 1024): mark touched pages
  3. _page_split_kernel (HAS_MASK)      grid 4 * pool pages: every program reads its mask byte,
                                        touched ones copy 64 rows + their scale footer
With swan the decode reads the 256-token pages in place: all three launches go.

Counts (default mode, CPU): the launches and grids are read off the engine's own function, run
on meta tensors with its two Triton kernels replaced by recorders (nothing is re-derived from
its source); bytes follow from the grids and the kernels' copy sizes.

    .venv/bin/python bench/swan_split_cost.py                 # counts table (JSON lines)
    python3 bench/swan_split_cost.py --gpu --engine-file PATH # time the engine's split on a GPU

--gpu times the engine's own `_split_kv_pages_to_64` under CUDA-graph replay: one graph holds 43
calls (one decode step, one SWA pool per layer), replayed; per-step and per-call microseconds.
It needs only torch + triton: the engine file is loaded from --engine-file with three tiny
stand-ins for the sglang modules it imports (environ.envs, utils.is_hip, runtime_context).
The sparse decode itself cannot run on sm_90 (FlashInfer's kernel is SM120/121 only).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
# The page layout is the adapter's (adapter/swan/layout.py imports nothing: fine on a device
# that has only torch and triton).
from adapter.swan.layout import (DATA_BYTES, PAGE_STRIDE, PAGE_TOKENS, ROW_BYTES,  # noqa: E402
                                 SCALE_BYTES, SPLIT_PAGE_STRIDE, SPLIT_PAGE_TOKENS)

LAYERS = 43
WINDOW = 128
TOPK = 128                      # SWA candidates per query row (window 128, aligned to 64)
DST_PAGE_STRIDE = SPLIT_PAGE_STRIDE
SUBPAGES = PAGE_TOKENS // SPLIT_PAGE_TOKENS           # 4 split pages per pool page
DATA_PER_SUB = SPLIT_PAGE_TOKENS * DATA_BYTES         # bytes a split program copies (data rows) ...
SCALE_PER_SUB = SPLIT_PAGE_TOKENS * SCALE_BYTES       # ... and scale footer
BASE_SWA_SLOTS = 35_328         # SPEC: 84,480 slots at 128 tails, 182,784 at 384,
SLOTS_PER_TAIL = 384            # headroom = tails x (window 128 + page 256)
TAILS = (128, 256, 384)
STREAMS = (1, 4, 16)
ROWS_PER_STREAM = (1, 4)        # decode / DSpark verify rows per stream; 16 x 4 = 64 rows


def pool_pages(tails: int) -> int:
    return (BASE_SWA_SLOTS + tails * SLOTS_PER_TAIL) // PAGE_TOKENS


def touched_pages(streams: int) -> int:
    """Worst case: each stream's window (plus its query rows) straddles a page boundary."""
    return 2 * streams


def stream_indices(streams: int, rows: int, pages: int, torch, device="cpu", seed=0):
    """[T, TOPK] int32 SWA slot indices: each stream owns two pages, its window straddles their
    boundary; the padding slots of a short window are -1 as in the engine."""
    g = torch.Generator().manual_seed(seed)
    owned = torch.randperm(pages, generator=g)[: 2 * streams].view(streams, 2)
    out = torch.full((streams * rows, TOPK), -1, dtype=torch.int32)
    for s in range(streams):
        first, second = (int(p) for p in owned[s])
        tail = 64 + s % 64                       # window tokens in the second page
        slots = [first * PAGE_TOKENS + PAGE_TOKENS - (WINDOW - tail) + i for i in range(WINDOW - tail)]
        slots += [second * PAGE_TOKENS + i for i in range(tail)]
        for r in range(rows):
            out[s * rows + r, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return out.to(device)


# ---------------------------------------------------------------------------------------------
# counts from the engine's own code path (CPU, meta tensors)

class _Recorder:
    def __init__(self, name):
        self.name = name
        self.grids = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(tuple(grid))
        return launch


def engine_counts(pages: int, rows: int, torch, m) -> dict:
    split, mark = _Recorder("split"), _Recorder("mark")
    memsets = []
    real_split, real_mark = m._page_split_kernel, m._page_mark_kernel
    real_zero = torch.Tensor.zero_

    def zero_(t):
        memsets.append(t.numel() * t.element_size())
        return real_zero(t)

    m._page_split_kernel, m._page_mark_kernel = split, mark
    torch.Tensor.zero_ = zero_
    try:
        kv = torch.empty(pages * PAGE_STRIDE, dtype=torch.uint8, device="meta").as_strided(
            (pages, PAGE_TOKENS, 1, ROW_BYTES), (PAGE_STRIDE, ROW_BYTES, ROW_BYTES, 1))
        idx = torch.empty(rows, TOPK, dtype=torch.int32, device="meta")
        m._split_kv_pages_to_64(kv, PAGE_TOKENS, touched_indices=idx)
    finally:
        m._page_split_kernel, m._page_mark_kernel = real_split, real_mark
        torch.Tensor.zero_ = real_zero
    assert len(split.grids) == 1 and len(mark.grids) == 1 and len(memsets) == 1
    return {"launches": 3, "mark_programs": math.prod(mark.grids[0]),
            "split_programs": math.prod(split.grids[0]), "memset_bytes": memsets[0]}


def counts_table(torch, m) -> list[dict]:
    rows_out = []
    for tails in TAILS:
        pages = pool_pages(tails)
        for streams in STREAMS:
            for per in ROWS_PER_STREAM:
                rows = streams * per
                c = engine_counts(pages, rows, torch, m)
                touched = touched_pages(streams)
                call_bytes = (c["memset_bytes"]                     # mask memset
                              + rows * TOPK * 4 + touched           # mark: read indices, set bytes
                              + c["split_programs"]                 # split: one mask byte each
                              + 2 * touched * SUBPAGES * (DATA_PER_SUB + SCALE_PER_SUB))  # copy r+w
                rows_out.append({
                    "tails": tails, "swa_slots": pages * PAGE_TOKENS, "pool_pages": pages,
                    "streams": streams, "rows": rows, "touched_pages": touched,
                    "per_call": dict(c, bytes=call_bytes),
                    "per_step": {"launches": LAYERS * c["launches"],
                                 "programs": LAYERS * (c["mark_programs"] + c["split_programs"]),
                                 "copying_programs": LAYERS * SUBPAGES * touched,
                                 "bytes": LAYERS * call_bytes,
                                 "split_buffer_bytes": pages * SUBPAGES * DST_PAGE_STRIDE},
                })
    return rows_out


# ---------------------------------------------------------------------------------------------
# GPU timing of the engine's own split (sm_90 is enough: the split kernels are Triton)

def load_engine_split(path: str):
    """The engine file, loaded under its own module name with stand-ins for the three sglang
    modules it imports (the device has torch and triton but no sglang)."""
    class _Env:
        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    class _Resources:
        buffers: dict = {}

    stubs = {
        "sglang": {}, "sglang.srt": {}, "sglang.kernels": {}, "sglang.kernels.ops": {},
        "sglang.kernels.ops.attention": {},
        "sglang.srt.environ": {"envs": types.SimpleNamespace(
            SGLANG_SM120_FLASHMLA_BACKEND=_Env("flashinfer"))},
        "sglang.srt.utils": {"is_hip": lambda: False},
        "sglang.srt.runtime_context": {"get_resources": lambda: _Resources},
    }
    for name, attrs in stubs.items():
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = []
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
    name = "sglang.kernels.ops.attention.flash_mla_sm120"
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


def gpu_times(m, torch, replays=200, pool_page_counts=None) -> list[dict]:
    dev = torch.device("cuda")
    results = []
    counts = pool_page_counts or sorted({pool_pages(t) for t in TAILS} | {4096})
    for pages in counts:
        pools = [torch.randint(0, 255, (pages * PAGE_STRIDE,), dtype=torch.uint8, device=dev)
                 for _ in range(LAYERS)]
        views = [p.as_strided((pages, PAGE_TOKENS, 1, ROW_BYTES), (PAGE_STRIDE, ROW_BYTES, ROW_BYTES, 1)) for p in pools]
        for streams in STREAMS:
            for per in ROWS_PER_STREAM:
                idx = stream_indices(streams, per, pages, torch, device=dev)
                for v in views:                       # warm up: compile, size persistent buffers
                    m._split_kv_pages_to_64(v, PAGE_TOKENS, touched_indices=idx)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for v in views:
                        m._split_kv_pages_to_64(v, PAGE_TOKENS, touched_indices=idx)
                for _ in range(20):
                    graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                torch.cuda.synchronize()
                step_us = start.elapsed_time(end) * 1000.0 / replays
                results.append({"pool_pages": pages, "streams": streams, "rows": streams * per,
                                "step_us": round(step_us, 2), "call_us": round(step_us / LAYERS, 2)})
                print(json.dumps(results[-1]), flush=True)
                del graph
        del pools, views
        torch.cuda.empty_cache()
    # the split output is correct for the timed configuration (a few touched pages checked)
    return results


def check_split_bytes(m, torch, device="cuda") -> bool:
    """Touched sub-pages of the engine's split buffer equal the source bytes (data + footer)."""
    dev = torch.device(device)
    pages = 16
    pool = torch.randint(0, 255, (pages * PAGE_STRIDE,), dtype=torch.uint8, device=dev)
    view = pool.as_strided((pages, PAGE_TOKENS, 1, ROW_BYTES), (PAGE_STRIDE, ROW_BYTES, ROW_BYTES, 1))
    idx = stream_indices(2, 1, pages, torch, device=dev)
    out = m._split_kv_pages_to_64(view, PAGE_TOKENS, touched_indices=idx)
    flat = torch.as_strided(out, (out.shape[0] * DST_PAGE_STRIDE,), (1,))
    ok = True
    for p in sorted({int(i) // PAGE_TOKENS for i in idx.flatten().tolist() if i >= 0}):
        for s in range(SUBPAGES):
            d = (p * SUBPAGES + s) * DST_PAGE_STRIDE
            src = p * PAGE_STRIDE
            footer = src + PAGE_TOKENS * DATA_BYTES
            ok &= torch.equal(flat[d:d + DATA_PER_SUB], pool[src + s * DATA_PER_SUB: src + (s + 1) * DATA_PER_SUB])
            ok &= torch.equal(flat[d + DATA_PER_SUB: d + DATA_PER_SUB + SCALE_PER_SUB],
                              pool[footer + s * SCALE_PER_SUB: footer + (s + 1) * SCALE_PER_SUB])
    return bool(ok)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="time the engine's split on a CUDA GPU")
    ap.add_argument("--engine-file", help="flash_mla_sm120.py of the pinned engine (--gpu)")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--json-out")
    args = ap.parse_args(argv)
    import torch

    if args.gpu:
        m = load_engine_split(args.engine_file)
        props = torch.cuda.get_device_properties(0)
        report = {"device": props.name, "sm": f"{props.major}{props.minor}",
                  "torch": torch.__version__, "triton": __import__("triton").__version__,
                  "split_bytes_ok": check_split_bytes(m, torch),
                  "times": gpu_times(m, torch, args.replays)}
    else:
        from adapter.cpu import cpu_engine

        cpu_engine.install_torchvision_shim()
        from sglang.kernels.ops.attention import flash_mla_sm120 as m

        report = {"layers": LAYERS, "topk": TOPK, "rows": counts_table(torch, m)}
        for row in report["rows"]:
            print(json.dumps(row))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(report, fh, indent=1)
    if args.gpu:
        print(json.dumps({k: v for k, v in report.items() if k != "times"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
