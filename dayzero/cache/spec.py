"""What cache a layer needs, declared by the layer itself.

Paged caches hold rows per token in blocks shared by every paged layer of a sequence (one block table
per sequence). State caches hold a constant-size state per running sequence, in slots.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class PagedSpec:
    """Per-token rows: name -> (row shape, dtype); allocated as [num_blocks, block_size, *shape]."""

    rows: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def bytes_per_token(self) -> int:
        return sum(_nbytes(s, d) for s, d in self.rows.values())


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state: name -> (shape, dtype); allocated as [num_slots, *shape]."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def bytes_per_seq(self) -> int:
        return sum(_nbytes(s, d) for s, d in self.tensors.values())


def allocate(spec: PagedSpec | StateSpec, count: int, block_size: int, device) -> dict[str, torch.Tensor]:
    """Zero-filled cache tensors for one layer: ``count`` blocks (paged) or slots (state)."""
    if isinstance(spec, PagedSpec):
        return {n: torch.zeros((count, block_size, *s), dtype=d, device=device) for n, (s, d) in spec.rows.items()}
    return {n: torch.zeros((count, *s), dtype=d, device=device) for n, (s, d) in spec.tensors.items()}
