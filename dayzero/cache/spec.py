"""What cache a layer needs, declared by the layer itself, and the pools that hold it.

Paged caches hold rows per token in blocks shared by every paged layer of a sequence (one block table
per sequence). State caches hold a constant-size state per running sequence, in slots.

A paged row is either key-like (``"key"``: quantised per channel, one scale per channel per block) or
value-like (``"value"``: one scale per token row), as DESIGN.md prescribes for fp8/int8 KV caches.
The MLA latent row serves as both key and value of the absorbed attention; it is quantised per token,
like vLLM's fp8 MLA layout, with a single scale for the whole 576-wide row (578 bytes instead of the
656-byte four-group layout: one scale costs 2 bytes and the row's channels share one dynamic range
after the latent RMSNorm), and the indexer key per token as in DeepSeek's 132-byte layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dayzero.cache.quant import PLAIN_KV_DTYPES, QuantPagedPool


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class PagedSpec:
    """Per-token rows: name -> (row shape, dtype); allocated as [num_blocks, block_size, *shape]."""

    rows: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # name -> "key" | "value" (default "value")

    def bytes_per_token(self, kv_cache_dtype: str = "auto", block_size: int = 16) -> int | float:
        if kv_cache_dtype in PLAIN_KV_DTYPES:
            plain = PLAIN_KV_DTYPES[kv_cache_dtype]
            return sum(_nbytes(s, plain or d) for s, d in self.rows.values())
        return sum(QuantPagedPool.bytes_per_token(s, self.roles.get(n, "value") == "key", block_size)
                   for n, (s, _) in self.rows.items())


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state: name -> (shape, dtype); allocated as [num_slots, *shape]."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def bytes_per_seq(self) -> int:
        return sum(_nbytes(s, d) for s, d in self.tensors.values())


def allocate(spec: PagedSpec | StateSpec, count: int, block_size: int, device, kv_cache_dtype: str = "auto") -> dict:
    """Cache storage for one layer: ``count`` blocks (paged) or slots (state). Paged rows are plain
    zero-filled tensors [count, block_size, *row] (in the model dtype for "auto", else the named one), or
    :class:`QuantPagedPool` for fp8/int8."""
    if isinstance(spec, StateSpec):
        return {n: torch.zeros((count, *s), dtype=d, device=device) for n, (s, d) in spec.tensors.items()}
    if kv_cache_dtype in PLAIN_KV_DTYPES:
        plain = PLAIN_KV_DTYPES[kv_cache_dtype]
        return {n: torch.zeros((count, block_size, *s), dtype=plain or d, device=device) for n, (s, d) in spec.rows.items()}
    return {
        n: QuantPagedPool(count, block_size, s, kv_cache_dtype, spec.roles.get(n, "value") == "key", device, d)
        for n, (s, d) in spec.rows.items()
    }
