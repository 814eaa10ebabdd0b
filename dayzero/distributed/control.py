"""Job-wide exchanges of the launcher, over the default (world) group that :func:`init_parallel` joined.

These carry control data, not activations: a pickled object from one rank to every rank (how the ranks of a
torchrun job find the driving rank's control channel) and the smallest of one integer over the ranks (so that
every rank plans the same cache, as their schedulers must take the same decisions).
"""
from __future__ import annotations

import torch


def broadcast_object(obj=None, src: int = 0):
    """``obj`` as rank ``src`` gave it, on every rank (the others pass nothing). Every rank must call it."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def world_min(values: list[int], device: torch.device | None = None) -> list[int]:
    """Each of ``values``' smallest over every rank of the job (``device``: where the backend reduces, the rank's
    CUDA device under NCCL). ``values`` themselves when no process group is joined."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.tolist()
