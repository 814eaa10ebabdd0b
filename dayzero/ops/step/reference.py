"""``step_inputs``: a step's index values scattered into the step buffers' arena, then the rows an overlapped step
takes from the previous step's samples (see :mod:`dayzero.engine.step_buffers`)."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("step_inputs")
def step_inputs(arena: torch.Tensor, stage: torch.Tensor, total: int, patch: tuple | None = None) -> None:
    # arena: [A] int64; stage: [>= 2 * total] int64, the values then their places in the arena; patch: (ids, rows,
    # src, tokens), views of the arena but tokens: ids[rows[i]] = max(tokens[src[i]], 0) after the scatter (-1, a
    # sample whose logits were not finite, reads token 0)
    arena.index_copy_(0, stage[total:2 * total], stage[:total])
    if patch is not None:
        ids, rows, src, tokens = patch
        ids.index_copy_(0, rows, tokens.index_select(0, src).clamp_min(0))
