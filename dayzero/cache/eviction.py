"""Eviction that adapts to the workload, for the prefix cache's snapshots and blocks.

Least recently used suits conversations, whose next turn asks for what the previous one just cached, but a
workload that comes back to more distinct prompts than the pool holds, in the same order, finds every entry
evicted just before it is asked for. Bimodal insertion (Qureshi et al., ISCA 2007: new entries go in at the
evicting end, one in 32 at the other) keeps part of such a cycle. :class:`EvictionDuel` keeps two key-only
copies of a pool, one per rule, that see the same insertions and lookups and are scored by which would have
resumed the longer prefix; the pool evicts first what the leading copy no longer holds (:meth:`victim`), so its
content follows that rule's.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

POLICIES = ("adaptive", "lru")
BIMODAL_EVERY = 32  # the bimodal rule inserts one entry in this many as most recently used
DUEL_LIMIT = 8  # where the score between the two rules saturates: lookups it takes to switch back
SCAN = 64  # entries a victim search looks at, least recently used first, before it takes the first


class KeyCopy:
    """The keys a pool of ``capacity`` entries would hold under one insertion rule, without the entries."""

    def __init__(self, capacity: int, bimodal: bool):
        self.capacity, self.bimodal = capacity, bimodal
        self.keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.inserts = 0

    def insert(self, key: bytes) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        if len(self.keys) >= self.capacity:
            self.keys.popitem(last=False)
        self.keys[key] = None
        if self.bimodal and self.inserts % BIMODAL_EVERY:
            self.keys.move_to_end(key, last=False)
        self.inserts += 1

    def longest(self, candidates: list[bytes]) -> int:
        """How many candidates (longest prefix first) from the first one held to the end; 0 if none. The one
        held is touched."""
        for i, key in enumerate(candidates):
            if key in self.keys:
                self.keys.move_to_end(key)
                return len(candidates) - i
        return 0

    def leading(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a prefix's blocks, first first) are held from the start on; those are touched."""
        n = 0
        while n < len(keys) and keys[n] in self.keys:
            self.keys.move_to_end(keys[n])
            n += 1
        return n


class EvictionDuel:
    """LRU against bimodal insertion over a pool of ``capacity`` entries, by which would have resumed more."""

    def __init__(self, capacity: int):
        self.copies = (KeyCopy(capacity, False), KeyCopy(capacity, True))
        self.score = 0  # > 0: the LRU copy matched more; < 0: the bimodal one

    @property
    def bimodal(self) -> bool:
        """Whether the bimodal rule leads: eviction then follows its copy."""
        return self.score < 0

    def insert(self, key: bytes) -> None:
        for copy in self.copies:
            copy.insert(key)

    def _scored(self, lru: int, bimodal: int) -> None:
        self.score = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.score + (lru > bimodal) - (bimodal > lru)))

    def observe_longest(self, candidates: list[bytes]) -> None:
        """A lookup that resumes from the longest candidate held (snapshots: longest prefix first)."""
        if candidates:
            self._scored(*(c.longest(candidates) for c in self.copies))

    def observe_leading(self, keys: list[bytes]) -> None:
        """A lookup that takes the blocks held from the first one on."""
        if keys:
            self._scored(*(c.leading(keys) for c in self.copies))

    def victim(self, entries: Iterable, key_of) -> object:
        """Of ``entries`` (least recently used first, not empty), the first of the first :data:`SCAN` whose key
        the leading copy no longer holds, else the first."""
        keep = self.copies[self.bimodal].keys
        first = None
        for n, entry in enumerate(entries):
            if key_of(entry) not in keep:
                return entry
            if first is None:
                first = entry
            if n + 1 >= SCAN:
                break
        return first
