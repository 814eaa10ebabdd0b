"""Weights that no kernel of a step writes, which a kernel may therefore read before waiting for the one before it.

Under programmatic dependent launch (:func:`dayzero.ops.triton_support.pdl`) a kernel is scheduled while its
predecessor still runs and waits at its first statement for that one's writes. A model weight is written when it
is loaded, never by a step's kernels, so a kernel may start reading it before the wait and overlap the read with
the kernel before (:func:`dayzero.ops.triton_support.preload`). Parameters count as such; a weight kept as a plain
tensor (the fused projections' concatenated weight, a scale folded into a weight once after loading) is marked
with :func:`mark_static` where it is made.
"""
from __future__ import annotations

import torch
from torch import nn

_MARK = "_dayzero_static"


def mark_static(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a weight no kernel of a step writes; returns it."""
    setattr(t, _MARK, True)
    return t


def is_static(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or was marked with :func:`mark_static` (a view of either is not: views are
    made per call and may be of anything)."""
    return isinstance(t, nn.Parameter) or getattr(t, _MARK, False)
