"""What every attention layer shares: it declares its cache, receives the tensors once, and writes
each step's new rows through the batch's slot mapping. No global context: the batch is an argument."""
from __future__ import annotations

import torch
from torch import nn

from dayzero.cache.spec import PagedSpec, StateSpec


class CachedLayer(nn.Module):
    cache: dict[str, torch.Tensor] | None = None

    def cache_spec(self, dtype: torch.dtype) -> PagedSpec | StateSpec:
        raise NotImplementedError

    def bind_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        self.cache = tensors

    def write_rows(self, name: str, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        pool = self.cache[name]  # [num_blocks, block_size, *row], or a quantised pool
        if isinstance(pool, torch.Tensor):
            pool.view(-1, *pool.shape[2:])[slot_mapping] = rows.to(pool.dtype)
        else:
            pool.write(slot_mapping, rows)

    def read_rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        pool = self.cache[name]
        if isinstance(pool, torch.Tensor):
            return pool.view(-1, *pool.shape[2:])[slots]
        return pool.read(slots)
