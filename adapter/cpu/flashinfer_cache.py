"""Stand-in for FlashInfer's autotuner cache files (FlashInfer tunes on GPUs only): what the
engine's `_drop_diverged_autotune_cache` and autotune_keep read on each rank.

"Tuning" writes a per-rank cache file in FlashInfer 0.7.2's save_configs() layout (`_metadata`
stamp, [runner, tactic] entries, `_generation`), with rank-specific entries as under expert
parallelism and tactics that depend on the boot (the timing noise that makes stock tactics
drift); "loading" parses it as load_configs() would; `_damage` corrupts or deletes a rank's files.
The environment stamp FlashInfer's `_collect_metadata()` returns on the cluster is a fixed dict.

Used by `dsv41 sim autotune` (adapter/tools/sims/autotune_keep.py) and the CPU server's agreement
rounds (adapter/cpu/autotune_agree.py); tests, sims and CPU test servers only.
"""
from __future__ import annotations

import hashlib
import json
import pathlib

# What FlashInfer's _collect_metadata() returns on the cluster (a stand-in: no GPU here).
STAMP = {"flashinfer_version": "0.7.2", "cuda_version": "13.0", "cublas_version": "130000",
         "cudnn_version": "91000", "cudnn_frontend_version": "1.12.0",
         "cutlass_dsl_version": "4.2.0", "gpu": "NVIDIA GB10"}

SHAPES = ("moe_gemm1|tokens=1", "moe_gemm1|tokens=64", "moe_gemm2|tokens=1", "moe_gemm2|tokens=64")


def cache_file(workdir: pathlib.Path, rank: int) -> pathlib.Path:
    return workdir / f"rank_tp{rank}_pp0_dp0.json"


def _damage(path: pathlib.Path, how: str) -> None:
    side = path.with_name(path.name + ".launch")
    if how == "cache-json":
        path.write_text(path.read_text()[: len(path.read_text()) // 2])
    elif how == "cache-entry":
        data = json.loads(path.read_text())
        data[SHAPES[0]] = "not-a-list"
        path.write_text(json.dumps(data))
    elif how == "cache-delete":
        path.unlink(missing_ok=True)
    elif how == "sidecar-json":
        side.write_text("{not json")
    elif how == "sidecar-delete":
        side.unlink(missing_ok=True)
    else:
        raise ValueError(how)


def _fake_tune(path: pathlib.Path, rank: int, boot_index: int, stamp: dict) -> dict:
    """Stand-in for FlashInfer tuning + save_configs(): per-rank entries, boot-dependent tactics."""
    configs = {}
    for shape in SHAPES + (f"moe_local_experts|ep_rank={rank}",):
        noise = hashlib.sha256(f"{boot_index}|{shape}".encode()).digest()[0] % 8
        configs[shape] = ["TrtllmGenFusedMoERunner", [noise, rank % 2]]
    out = {"_metadata": stamp, **dict(sorted(configs.items()))}
    out["_generation"] = hashlib.sha256(json.dumps(out, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(out, indent=2))
    return configs


def _load_like_flashinfer(path: pathlib.Path) -> dict:
    configs = json.loads(path.read_text())
    for k in ("_metadata", "_records", "_generation"):
        configs.pop(k, None)
    return {k: (v[0], v[1]) for k, v in configs.items()}
