"""What every attention layer shares: it declares its cache, receives the tensors once, and writes
each step's new rows through the batch's slot mapping. No global context: the batch is an argument."""
from __future__ import annotations

import torch
from torch import nn

from dayzero.cache.rows import read_rows, write_rows
from dayzero.cache.spec import PagedSpec, StateSpec


class CachedLayer(nn.Module):
    cache: dict[str, torch.Tensor] | None = None
    cache_group: int = 0  # the block group whose tables address its paged rows (ForwardBatch.group)

    def cache_spec(self, dtype: torch.dtype) -> PagedSpec | StateSpec:
        raise NotImplementedError

    def bind_cache(self, tensors: dict[str, torch.Tensor]) -> None:
        self.cache = tensors

    def write_rows(self, name: str, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
        write_rows(self.cache[name], slot_mapping, rows)

    def read_rows(self, name: str, slots: torch.Tensor) -> torch.Tensor:
        return read_rows(self.cache[name], slots)

    def process_weights_after_loading(self) -> None:
        """Derive, once after the weights load, what the forward pass would otherwise re-derive every step."""
