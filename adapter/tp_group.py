"""The engine's attention TP group, for the decisions every rank of it must make alike.

Ranks of one attention-TP group run the same batches (the same requests, the same decode calls on
their share of the heads). A decision that rests on a rank-local reading (a check's bits, a step's
time) is taken by each rank for itself and then agreed: one all-reduce (MAX) over the group's gloo
CPU group, so every rank adopts the same verdict at the same point of its scheduler loop.
Used by swan's self-check and the input guard's grammar step bound.
"""
from __future__ import annotations


def engine_group():
    """(gloo CPU group, world size, rank in group) of the engine's attention TP group (the whole
    TP group without DP attention, as on the cluster). (None, 1, 0) in a process without the
    engine's groups (tests, `dsv41 check`)."""
    from sglang.srt.runtime_context import get_parallel

    try:
        group = get_parallel().attn_tp_group
    except (RuntimeError, ValueError, AttributeError):   # groups not built in this process
        return None, 1, 0
    return group.cpu_group, int(group.world_size), int(group.rank_in_group)


def all_reduce_max(values: list[int], group) -> list[int]:
    """Element-wise MAX of `values` over `group` (torch.distributed, gloo: CPU tensors)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [int(v) for v in t.tolist()]
