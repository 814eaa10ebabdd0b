"""The cache manager owns blocks and state slots and hands the scheduler opaque per-sequence handles.

The scheduler asks only: can this sequence grow to N tokens (``can_grow``), grow it (``grow``), and
release it (``release``). Tensors and slot arithmetic stay here and in the batch builder.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dayzero.cache.block_pool import BlockPool, SlotPool


@dataclass
class CacheHandle:
    blocks: list[int] = field(default_factory=list)
    slot: int | None = None


class CacheManager:
    def __init__(self, block_size: int, num_blocks: int, num_slots: int, uses_blocks: bool = True, uses_slots: bool = True):
        self.block_size = block_size
        self.uses_blocks, self.uses_slots = uses_blocks, uses_slots
        self.blocks = BlockPool(num_blocks)
        self.slots = SlotPool(num_slots)
        self.handles: dict[int, CacheHandle] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.uses_blocks else 0

    def capacity_tokens(self) -> int:
        return (self.blocks.num_blocks - 1) * self.block_size

    def _missing(self, seq_id: int, num_tokens: int) -> tuple[int, int]:
        h = self.handles.get(seq_id)
        have_blocks = len(h.blocks) if h else 0
        need_slot = int(self.uses_slots and (h is None or h.slot is None))
        return max(0, self.blocks_for(num_tokens) - have_blocks), need_slot

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        nb, ns = self._missing(seq_id, num_tokens)
        return nb <= self.blocks.num_free and ns <= self.slots.num_free

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make sure ``seq_id`` holds cache for ``num_tokens`` tokens; False (nothing taken) if it cannot."""
        if not self.can_grow(seq_id, num_tokens):
            return False
        nb, ns = self._missing(seq_id, num_tokens)
        h = self.handles.setdefault(seq_id, CacheHandle())
        h.blocks += self.blocks.allocate(nb)
        if ns:
            h.slot = self.slots.allocate()
        return True

    def release(self, seq_id: int) -> None:
        h = self.handles.pop(seq_id, None)
        if h is None:
            return
        self.blocks.release(h.blocks)
        if h.slot is not None:
            self.slots.release(h.slot)

    def handle(self, seq_id: int) -> CacheHandle:
        return self.handles[seq_id]

    def usage(self) -> dict[str, int]:
        return {
            "blocks_total": self.blocks.num_blocks - 1, "blocks_free": self.blocks.num_free,
            "slots_total": self.slots.num_slots, "slots_free": self.slots.num_free,
        }
