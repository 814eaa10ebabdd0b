"""What cache a layer needs, declared by the layer itself, and the pools that hold it.

Paged caches hold rows per token in blocks shared by every paged layer of a sequence (one block table
per sequence). State caches hold a constant-size state per running sequence, in slots. A layer may need
both (DeepSeek-V4's compressed attention: paged compressed entries plus per-sequence rings), and then
declares a tuple of specs.

A paged row may also stand for ``stride`` tokens (a compressed entry per m tokens): a block then holds
``ceil(block_size / stride)`` such rows, and the entry of tokens ``w·m .. w·m+m-1`` lives in the block of
token ``w·m`` (see ``ForwardBatch.entry_slots``).

A layer that attends over a sliding window (``window``: each query reads the keys of the last ``window``
positions, itself included) needs a block only while some position it will still compute reads it: its
rows may live in a pool of their own, with a block table of their own, whose blocks go back as they fall
out of the window (:class:`~dayzero.cache.manager.CacheManager`).

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


# rows the indexer reads (DSA and compressed-attention indexer keys): ``index_cache_dtype`` may store them
# apart from the KV rows, e.g. fp8 indexer keys (130 bytes per 128-wide key with its bf16 scale, not 256)
INDEX_ROWS = ("index_k",)


def row_cache_dtype(name: str, kv_cache_dtype: str = "auto", index_cache_dtype: str = "auto") -> str:
    """The cache dtype of row kind ``name``: ``index_cache_dtype`` for the indexer's keys unless it is "auto",
    else ``kv_cache_dtype``."""
    return index_cache_dtype if name in INDEX_ROWS and index_cache_dtype != "auto" else kv_cache_dtype


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


@dataclass(frozen=True)
class PagedSpec:
    """Per-token rows: name -> (row shape, dtype); allocated as [num_blocks, block_size, *shape]."""

    rows: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)  # name -> "key" | "value" (default "value")
    strides: dict[str, int] = field(default_factory=dict)  # name -> tokens per row (default 1)
    window: int | None = None  # keys a query reads, the newest first (a sliding window); None: every key

    def rows_per_block(self, name: str, block_size: int) -> int:
        return -(-block_size // self.strides.get(name, 1))

    def only(self, name: str) -> PagedSpec:
        """The spec of one row kind, with its role and stride."""
        keep = lambda d: {name: d[name]} if name in d else {}  # noqa: E731
        return PagedSpec(keep(self.rows), keep(self.roles), keep(self.strides), self.window)

    def bytes_per_token(self, kv_cache_dtype: str = "auto", block_size: int = 16,
                        index_cache_dtype: str = "auto") -> int | float:
        total = 0.0
        for n, (shape, dtype) in self.rows.items():
            per_block = self.rows_per_block(n, block_size)
            kind = row_cache_dtype(n, kv_cache_dtype, index_cache_dtype)
            if kind in PLAIN_KV_DTYPES:
                row = _nbytes(shape, PLAIN_KV_DTYPES[kind] or dtype)
            else:
                row = QuantPagedPool.bytes_per_token(shape, self.roles.get(n, "value") == "key", per_block)
            total += row * per_block / block_size
        return int(total) if total == int(total) else total


@dataclass(frozen=True)
class StateSpec:
    """Per-sequence state: name -> (shape, dtype); allocated as [num_slots, *shape]."""

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    def bytes_per_seq(self) -> int:
        return sum(_nbytes(s, d) for s, d in self.tensors.values())


def parts(spec) -> tuple[PagedSpec | StateSpec, ...]:
    """A layer's cache declaration as a tuple of specs (it may declare one spec or several)."""
    return spec if isinstance(spec, tuple) else (spec,)


def allocate(spec: PagedSpec | StateSpec, count: int, block_size: int, device, kv_cache_dtype: str = "auto",
             index_cache_dtype: str = "auto") -> dict:
    """Cache storage for one spec: ``count`` blocks (paged) or slots (state). Paged rows are plain
    zero-filled tensors [count, rows per block, *row] (in the model dtype for "auto", else the named one),
    or :class:`QuantPagedPool` for fp8/int8."""
    if isinstance(spec, StateSpec):
        return {n: torch.zeros((count, *s), dtype=d, device=device) for n, (s, d) in spec.tensors.items()}
    out = {}
    for n, (s, d) in spec.rows.items():
        per_block = spec.rows_per_block(n, block_size)
        kind = row_cache_dtype(n, kv_cache_dtype, index_cache_dtype)
        if kind in PLAIN_KV_DTYPES:
            out[n] = torch.zeros((count, per_block, *s), dtype=PLAIN_KV_DTYPES[kind] or d, device=device)
        else:
            out[n] = QuantPagedPool(count, per_block, s, kind, spec.roles.get(n, "value") == "key", device, d)
    return out
