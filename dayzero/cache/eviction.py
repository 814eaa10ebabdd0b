"""Eviction that adapts to the workload, for the prefix cache's snapshots and blocks.

Least recently used suits conversations, whose next turn asks for what the previous one just cached, but a
workload that comes back to more distinct prompts than the pool holds, in the same order, finds every entry
evicted just before it is asked for. Bimodal insertion (Qureshi et al., ISCA 2007: new entries go in at the
evicting end, one in 32 at the other) keeps part of such a cycle. Entries that are only useful together (a
prompt's blocks: a hit needs every one from the first on) are inserted with a ``group`` (the sequence), and the
bimodal rule decides once per group, so that it keeps whole prompts rather than one block of each.

:class:`EvictionDuel` keeps two key-only copies of a pool, one per rule, that see the same insertions and
lookups and are scored by which would have resumed the longer prefix; each lookup's misses are cached in each
copy as the sequence would compute them. The pool evicts first what the leading copy no longer holds
(:meth:`~EvictionDuel.victim`: each copy keeps, in the order it dropped them, the keys the pool still caches
and it does not), so its content follows that rule's.
"""
from __future__ import annotations

from collections import OrderedDict

POLICIES = ("adaptive", "lru")
BIMODAL_EVERY = 32  # the bimodal rule inserts one entry in this many as most recently used
DUEL_LIMIT = 8  # where the score between the two rules saturates: lookups it takes to switch back
SCAN = 64  # dropped keys a victim search passes over (their entries held) before it takes the pool's LRU
GROUPS_KEPT = 4096  # the bimodal rule remembers its decision for this many groups, the most recent


class KeyCopy:
    """The keys a pool of ``capacity`` entries would hold under one insertion rule, without the entries."""

    def __init__(self, capacity: int, bimodal: bool, cached=None):
        self.capacity, self.bimodal = capacity, bimodal
        self.cached = cached or (lambda key: False)  # whether the pool itself caches a key
        self.keys: OrderedDict[bytes, None] = OrderedDict()  # least recently used first
        self.dropped: OrderedDict[bytes, None] = OrderedDict()  # cached by the pool, no longer here; oldest first
        self.inserts = 0  # decisions taken: entries inserted without a group, and groups
        self.groups: OrderedDict[object, bool] = OrderedDict()  # group -> whether it goes in as recently used

    def insert(self, key: bytes, group=None) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        if len(self.keys) >= self.capacity:
            old = self.keys.popitem(last=False)[0]
            if self.cached(old):
                self.dropped[old] = None
        self.keys[key] = None
        self.dropped.pop(key, None)
        if self.bimodal and not self._recent(group):
            self.keys.move_to_end(key, last=False)

    def resize(self, capacity: int) -> None:
        """The pool can cache ``capacity`` entries now (sequences hold the rest): the copy drops, by its rule, what
        no longer fits."""
        self.capacity = capacity
        while len(self.keys) > max(capacity, 0):
            old = self.keys.popitem(last=False)[0]
            if self.cached(old):
                self.dropped[old] = None

    def _recent(self, group) -> bool:
        """The bimodal rule's decision for an entry of ``group`` (None: the entry alone): one in
        :data:`BIMODAL_EVERY` goes in as most recently used."""
        if group is not None and group in self.groups:
            self.groups.move_to_end(group)
            return self.groups[group]
        recent = self.inserts % BIMODAL_EVERY == 0
        self.inserts += 1
        if group is not None:
            self.groups[group] = recent
            if len(self.groups) > GROUPS_KEPT:
                self.groups.popitem(last=False)
        return recent

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
    """LRU against bimodal insertion over a pool of ``capacity`` entries, by which would have resumed more;
    ``cached(key)``: whether the pool caches ``key`` now (it calls :meth:`forget` when it stops)."""

    def __init__(self, capacity: int, cached=None):
        self.copies = (KeyCopy(capacity, False, cached), KeyCopy(capacity, True, cached))
        self.score = 0  # > 0: the LRU copy matched more; < 0: the bimodal one

    @property
    def bimodal(self) -> bool:
        """Whether the bimodal rule leads: eviction then follows its copy."""
        return self.score < 0

    def insert(self, key: bytes, group=None, touch: bool = True) -> None:
        """``key`` cached; entries of one ``group`` (a sequence's blocks) are placed alike by the bimodal rule.
        ``touch=False``: a copy that holds ``key`` already (its lookup put it there) leaves it where it is."""
        for copy in self.copies:
            if touch or key not in copy.keys:
                copy.insert(key, group)

    def _scored(self, lru: int, bimodal: int) -> None:
        self.score = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.score + (lru > bimodal) - (bimodal > lru)))

    def observe_longest(self, candidates: list[bytes]) -> None:
        """A lookup that resumes from the longest candidate held (snapshots: longest prefix first)."""
        if candidates:
            self._scored(*(c.longest(candidates) for c in self.copies))

    def observe_leading(self, keys: list[bytes], group=None) -> None:
        """A lookup that takes the blocks held from the first one on; each copy then caches the rest, as the
        sequence computes them, whether or not the pool itself found them (``group``: the sequence)."""
        if keys:
            held = [c.leading(keys) for c in self.copies]
            self._scored(*held)
            for copy, n in zip(self.copies, held):
                for key in keys[n:]:
                    copy.insert(key, group)

    def resize(self, capacity: int) -> None:
        """Entries the pool can cache now: fewer while sequences hold blocks they are still filling."""
        for copy in self.copies:
            copy.resize(capacity)

    def forget(self, key: bytes) -> None:
        """The pool no longer caches ``key``."""
        for copy in self.copies:
            copy.dropped.pop(key, None)

    def victim(self, evictable, lru):
        """The entry to evict: of the keys the leading copy dropped (the oldest first, at most :data:`SCAN`), the
        first whose entry ``evictable(key)`` gives (None: held, not evictable now); else ``lru()``, the pool's
        least recently used evictable entry."""
        for n, key in enumerate(self.copies[self.bimodal].dropped):
            entry = evictable(key)
            if entry is not None:
                return entry
            if n + 1 >= SCAN:
                break
        return lru()
