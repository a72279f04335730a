"""DSV41CPU_AUTOTUNE_AGREE=<dir> (tests only): the autotune cache agreement across a CPU server's
real TP group, which the CPU engine never reaches on its own (FlashInfer tunes on GPUs only).

Once a scheduler is up (its `Scheduler.__init__` has returned: the TP groups exist), it runs the
engine's own `_drop_diverged_autotune_cache` three times on its per-rank cache file in <dir>, over
the engine's own tactic sync group (`_autotune_tactic_sync_group(get_parallel().tp_group)`: the
gloo CPU group of the TP ranks, across the nodes of a multi-node boot), with autotune_keep wrapped
around it when its key is set, as the engine does before tuning:
  1. no cache on any rank: every rank "tunes" (adapter/cpu/flashinfer_cache.py, the stand-in for
     FlashInfer's save_configs layout) and autotune_keep seals the launch sidecar, as its context
     hook does after the engine saved;
  2. the caches are there on every rank: kept on every rank;
  3. the last rank's cache is corrupted first: that rank cannot load it, so every rank drops its
     own (the stock exchange, with autotune_keep's digests).
Each round ends with one line per rank: "[dsv41-cpu] autotune agreement round <n> rank <r>:
cache kept|absent". Ranks take part only with more than one TP rank (the engine skips the
exchange otherwise). Nothing else of the server is touched.
"""
from __future__ import annotations

import functools
import os
import pathlib
import sys

ENV = "DSV41CPU_AUTOTUNE_AGREE"
MODULE = "sglang.srt.managers.scheduler"
ENGINE_MODULE = "sglang.srt.model_executor.runner.flashinfer_autotune"


def apply(module) -> None:
    """Post-import hook on the scheduler module: run the rounds after Scheduler.__init__."""
    cls = module.Scheduler
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        run_rounds(pathlib.Path(os.environ[ENV]))

    cls.__init__ = __init__


def run_rounds(workdir: pathlib.Path) -> None:
    import importlib

    from sglang.srt.runtime_context import get_parallel

    from adapter.cpu import flashinfer_cache as fi_cache

    mod = importlib.import_module(ENGINE_MODULE)
    parallel = get_parallel()
    group = mod._autotune_tactic_sync_group(parallel.tp_group)
    if group is None:
        return
    rank, world = parallel.tp_rank, parallel.tp_size
    workdir.mkdir(parents=True, exist_ok=True)
    path = fi_cache.cache_file(workdir, rank)
    keep = _keep_installed()
    for n in (1, 2, 3):
        if n == 3 and rank == world - 1 and path.is_file():
            fi_cache._damage(path, "cache-json")
        mod._drop_diverged_autotune_cache(path, group, dict(fi_cache.STAMP))
        if n == 1 and not path.is_file():
            fi_cache._fake_tune(path, rank, 0, dict(fi_cache.STAMP))
            if keep is not None:
                keep.seal(path)
        sys.stderr.write(f"[dsv41-cpu] autotune agreement round {n} rank {rank}: cache "
                         f"{'kept' if path.is_file() else 'absent'}\n")
        sys.stderr.flush()
    group_barrier(group)


def group_barrier(group) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


def _keep_installed():
    from adapter import installer

    state = installer.status().get("autotune_keep")
    if state is None or state.status != "installed":
        return None
    from adapter import autotune_keep

    return autotune_keep
