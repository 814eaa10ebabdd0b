"""Weights that no kernel of a step writes, which a kernel may therefore read before waiting for the one before it.

Under programmatic dependent launch (:func:`dayzero.ops.triton_support.pdl`) a kernel is scheduled while its
predecessor still runs and waits at its first statement for that one's writes. A model weight is written when it
is loaded, never by a step's kernels, so a kernel may start reading it before the wait and overlap the read with
the kernel before (:func:`preload`, :func:`weight_tile`). Parameters count as such; a weight kept as a plain
tensor (a fused weight made once after loading) is marked with :func:`mark_static` where it is made.
``tests/ops/test_pdl.py`` holds every kernel to this one read before its wait (a :func:`weight_tile` under a
``PRELOAD`` flag) and no other, but for ``kda_decode``'s carried state (its layer's state and windows, which only
that kernel writes). ``kda_decode`` reads its gates' up-projections so.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from dayzero.ops.triton_support import HAS_TRITON, pdl, tl, triton

_MARK = "_dayzero_static"


def mark_static(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a weight no kernel of a step writes; returns it."""
    setattr(t, _MARK, True)
    return t


def is_static(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or was marked with :func:`mark_static` (a view of either is not: views are
    made per call and may be of anything)."""
    return isinstance(t, nn.Parameter) or getattr(t, _MARK, False)


def preload(t: torch.Tensor, weight: torch.Tensor) -> dict:
    """:func:`~dayzero.ops.triton_support.pdl`'s options for a kernel on ``t``'s device reading ``weight``, and
    ``PRELOAD``: whether it may read the weight before its wait (:func:`is_static`; off with
    ``DAYZERO_WEIGHT_PRELOAD=0``). Without PDL the early read only moves a load."""
    return {**pdl(t), "PRELOAD": os.environ.get("DAYZERO_WEIGHT_PRELOAD", "1") != "0" and is_static(weight)}


if HAS_TRITON:
    @triton.jit
    def weight_tile(w_rows, k, n_ok, K, EVEN_K: tl.constexpr):
        """The weight tile [rows, k] at row pointers ``w_rows`` (rows where not ``n_ok``, and columns past K unless
        EVEN_K, read as zero). The one load a kernel may issue before its ``grid_dependency``, and only of a weight
        no kernel of the step writes (``PRELOAD``, :func:`preload`)."""
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
        return w
