"""Physical cache blocks: reference counts and a free list. Block 0 is the null block, never handed out
(padding in block tables points at it)."""
from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_cache_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free = deque(range(1, num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free)} free")
        ids = [self.free.popleft() for _ in range(n)]
        for i in ids:
            self.ref_cnt[i] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            self.ref_cnt[i] += 1

    def release(self, ids: list[int]) -> None:
        # the request's last block goes back first-in-line for reuse last (ARCHITECTURE.md 5)
        for i in reversed(ids):
            if self.ref_cnt[i] <= 0:
                raise RuntimeError(f"block {i} released more often than allocated")
            self.ref_cnt[i] -= 1
            if self.ref_cnt[i] == 0:
                self.free.append(i)


class SlotPool:
    """Constant-size state slots for linear-attention layers, one per running sequence. Slot 0 is the null
    slot, never handed out (padding rows of a captured decode step read and write it): the state tensors
    hold ``num_slots + 1`` rows and sequences get slots 1 .. num_slots."""

    NULL = 0

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = deque(range(1, num_slots + 1))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("no free state slot")
        return self.free.popleft()

    def release(self, slot: int) -> None:
        if slot in self.free:
            raise RuntimeError(f"state slot {slot} released twice")
        self.free.append(slot)
