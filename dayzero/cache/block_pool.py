"""Physical cache blocks: reference counts, a free list, and (with prefix caching) the blocks whose content a
later request may reuse. Block 0 is the null block, never handed out (padding in block tables points at it).

A full block whose tokens are known is registered under the hash of its prefix (:mod:`dayzero.cache.prefix`).
When its last user releases it, it is not freed but kept, evictable, in least-recently-used order: a new
request with the same prefix takes it back (``acquire``) instead of computing it again. Allocation takes free
blocks first and evicts a cached one only when none is left, so a block that some sequence holds (reference
count > 0) is never evicted: the least recently used, or with ``policy="adaptive"`` the least recently used
that the leading rule of :class:`~dayzero.cache.eviction.EvictionDuel` would no longer hold.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from dayzero.cache.eviction import POLICIES, EvictionDuel

NULL_BLOCK = 0  # never handed out: padding in block tables points at it


class BlockPool:
    def __init__(self, num_blocks: int, policy: str = "lru"):
        if num_blocks < 2:
            raise ValueError(f"num_cache_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if policy not in POLICIES:
            raise ValueError(f"block eviction policy must be one of {POLICIES}, got {policy!r}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free = deque(range(1, num_blocks))
        self.cached: dict[bytes, int] = {}  # prefix hash -> block holding that prefix's last block of rows
        self.hash_of: dict[int, bytes] = {}  # the inverse, for the blocks registered
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; least recently used first
        self.duel = EvictionDuel(num_blocks - 1, self.cached.__contains__) if policy == "adaptive" else None
        self.num_evicted = 0
        self.on_evict = None  # (block, prefix hash) -> None, called before an evicted block is handed out

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: the free ones and the cached ones nobody holds."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        ids = []
        for _ in range(n):
            if self.free:
                i = self.free.popleft()
            else:  # a cached block nobody holds: the least recently used (or as the duel says)
                if self.duel is not None:  # blocks held and not yet cached leave the cache this much room
                    filling = self.num_used - (len(self.hash_of) - len(self.evictable))
                    self.duel.resize(self.num_blocks - 1 - filling)
                i = self._lru() if self.duel is None else self.duel.victim(self._unheld, self._lru)
                del self.evictable[i]
                key = self.hash_of.pop(i)
                del self.cached[key]
                if self.duel is not None:
                    self.duel.forget(key)
                self.num_evicted += 1
                if self.on_evict is not None:
                    self.on_evict(i, key)
            self.ref_cnt[i] = 1
            ids.append(i)
        return ids

    def _lru(self) -> int:
        return next(iter(self.evictable))

    def _unheld(self, key: bytes) -> int | None:
        """The cached block of ``key`` if nobody holds it."""
        block = self.cached.get(key)
        return block if block in self.evictable else None

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
                if i in self.hash_of:
                    self.evictable[i] = None  # most recently used last
                else:
                    self.free.append(i)

    # --- prefix caching --------------------------------------------------------------------------------
    def register(self, block: int, prefix_hash: bytes, group=None) -> None:
        """``block`` (held, full) holds the rows of the prefix ``prefix_hash``; the first block registered for a
        prefix is the one reused (a later duplicate stays private). ``group``: the sequence whose blocks these
        are, kept or dropped together by the eviction rules."""
        if prefix_hash not in self.cached and block not in self.hash_of:
            self.cached[prefix_hash] = block
            self.hash_of[block] = prefix_hash
            if self.duel is not None:
                self.duel.insert(prefix_hash, group, touch=False)

    def observe(self, keys: list[bytes], group=None) -> None:
        """A new sequence's (``group``'s) lookup of its blocks' keys, first block first (scores the eviction
        rules)."""
        if self.duel is not None:
            self.duel.observe_leading(keys, group)

    def lookup(self, prefix_hash: bytes) -> int | None:
        return self.cached.get(prefix_hash)

    def acquire(self, block: int) -> None:
        """Take a cached block for one more user (out of the evictable list if nobody held it)."""
        if self.ref_cnt[block] == 0:
            del self.evictable[block]
        self.ref_cnt[block] += 1


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
