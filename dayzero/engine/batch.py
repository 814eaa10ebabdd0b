"""The flat batch of one engine step: every scheduled token of every sequence in one list.

Sequence b owns rows ``query_start[b]:query_start[b+1]``; its tokens have positions
``seq_start[b] .. seq_lens[b]-1`` (``seq_start`` = tokens already in the cache before this step).
New rows are written into the paged caches at ``slot_mapping`` (slot = block_id * block_size + offset);
``key_slots[b]`` lists the cache slots of all ``seq_lens[b]`` tokens of sequence b, for reference ops
that gather keys. ``state_slots[b]`` is the sequence's slot in linear-attention state caches.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    query_start: list[int]  # [B+1], host copy of cu_seqlens
    seq_start: list[int]  # [B] tokens in the cache before this step
    seq_lens: list[int]  # [B] tokens in the cache after this step
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, 0 (the null block) where unused
    state_slots: torch.Tensor  # [B] int64
    logits_indices: torch.Tensor  # [S] int64 rows whose next-token logits are sampled
    block_size: int
    cu_seqlens: torch.Tensor = field(init=False)  # [B+1] int64, device copy of query_start
    fresh: torch.Tensor = field(init=False)  # [B] bool, sequences starting at position 0 (reset state)
    _key_slots: list[torch.Tensor] | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        dev = self.input_ids.device
        self.cu_seqlens = torch.tensor(self.query_start, dtype=torch.int64, device=dev)
        self.fresh = torch.tensor([s == 0 for s in self.seq_start], dtype=torch.bool, device=dev)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_query_len(self) -> int:
        return max((b - a for a, b in zip(self.query_start, self.query_start[1:])), default=0)

    def rows(self, b: int) -> slice:
        return slice(self.query_start[b], self.query_start[b + 1])

    def entry_slots(self, b: int | slice, stride: int, entries: torch.Tensor) -> torch.Tensor:
        """Slots of sequence b's compressed entries ``entries`` in a pool of one row per ``stride`` tokens:
        entry w (tokens w·stride ..) is row ``(w·stride mod block_size) // stride`` of the block of token w·stride.
        ``b=slice(None)`` gives every sequence's [B, len(entries)]; entries past a sequence's blocks read the
        last column of its table (padding for the caller to mask)."""
        per_block = -(-self.block_size // stride)
        pos = entries * stride
        col = (pos // self.block_size).clamp(max=self.block_tables.shape[1] - 1)
        return self.block_tables[b, col] * per_block + (pos % self.block_size) // stride

    def key_slots(self, b: int) -> torch.Tensor:
        """Cache slots of tokens 0..seq_lens[b]-1 of sequence b (computed once per step, shared by layers)."""
        if self._key_slots is None:
            self._key_slots = []
            for i, n in enumerate(self.seq_lens):
                pos = torch.arange(n, device=self.block_tables.device)
                self._key_slots.append(self.block_tables[i, pos // self.block_size] * self.block_size + pos % self.block_size)
        return self._key_slots[b]
