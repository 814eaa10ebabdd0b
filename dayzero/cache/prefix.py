"""Prefix caching: which earlier computation a new request can reuse, and the state snapshots that make it
possible for layers whose cache is a running state.

A full block of ``block_size`` tokens is named by a hash chained over every token id from the sequence start:
``h_i = H(h_{i-1}, tokens of block i)`` (BLAKE2b, 128 bits: a collision would silently reuse wrong rows, so
no 64-bit hash). Two sequences whose first ``i`` blocks hold the same tokens share ``h_i``, and therefore the
paged rows of those blocks (keys and values at the same positions).

A linear-attention layer (KDA, Gated DeltaNet, Mamba-2, their conv windows) or a compressed-attention ring has
no per-token rows to share: its state after token p is a function of all tokens 0..p. So the state is copied
out, a *snapshot*, at block-aligned points (every ``interval`` tokens, and at the last aligned point short of each
prompt), keyed by the prefix hash there. A request resumes from the last snapshot at or before the prefix it
shares, never beyond it; the scheduler ends prefill chunks at snapshot points so that the state exists there.
Snapshots live in extra rows of the state tensors (after the slots), least recently used evicted first.

Which snapshot to evict adapts to the workload (``policy="adaptive"``): least recently used suits
conversations, whose next turn asks for the snapshot just taken, but a workload that comes back to more distinct
prompts than the pool holds, in the same order, finds every snapshot evicted just before it is asked for.
Bimodal insertion (Qureshi et al., ISCA 2007: new entries go in at the evicting end, one in 32 at the other)
keeps part of such a cycle. Two key-only copies of the pool, one per rule, see the same snapshots and lookups and
are scored by which would have resumed the longer prefix; the pool evicts first what the leading copy no
longer holds, so its content follows that rule's.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict


def block_hashes(token_ids, block_size: int, num_blocks: int, known: list[bytes], extra_keys=None) -> list[bytes]:
    """``known`` (the hashes of the first blocks, extended in place) up to ``num_blocks`` full blocks.
    ``extra_keys(start, end)``, when given, is hashed into the block of tokens start..end-1 too: what its rows
    depend on beyond the token ids (the content hash and offset of each image whose placeholder tokens it holds,
    whose ids are the same for every image); b"" leaves a block's hash as it is without it."""
    while len(known) < num_blocks:
        i = len(known)
        h = hashlib.blake2b(digest_size=16)
        h.update(known[-1] if known else b"dayzero-prefix")
        h.update(array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes())
        if extra_keys is not None:
            h.update(extra_keys(i * block_size, (i + 1) * block_size))
        known.append(h.digest())
    return known


BIMODAL_EVERY = 32  # the bimodal rule inserts one snapshot in this many as most recently used
DUEL_LIMIT = 8  # where the score between the two rules saturates: lookups it takes to switch back


class _Shadow:
    """The keys a pool of ``capacity`` rows would hold under one insertion rule, without the rows."""

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
        if not insert_recent(self.bimodal, self.inserts):
            self.keys.move_to_end(key, last=False)
        self.inserts += 1

    def longest(self, candidates: list[bytes]) -> int:
        """How many candidates (longest prefix first) from the one it holds to the end; 0 if none (it is touched)."""
        for i, key in enumerate(candidates):
            if key in self.keys:
                self.keys.move_to_end(key)
                return len(candidates) - i
        return 0


def insert_recent(bimodal: bool, inserts: int) -> bool:
    """Whether the ``inserts``-th new entry goes in as most recently used (always under LRU)."""
    return not bimodal or inserts % BIMODAL_EVERY == 0


POLICIES = ("adaptive", "lru")


class SnapshotPool:
    """Rows ``first .. first + count - 1`` of every state tensor, each holding the states after one prefix;
    ``policy`` "lru" evicts the least recently used, "adaptive" also chooses where a new one goes (above)."""

    def __init__(self, first: int, count: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"snapshot eviction policy must be one of {POLICIES}, got {policy!r}")
        self.first, self.count = first, count
        self.free = list(range(first, first + count))[::-1]
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> row; least recently used first
        self.num_evicted = 0
        self.on_evict = None  # (row, prefix hash) -> None, called before an evicted row is reused
        self.adaptive = policy == "adaptive" and count > 0
        self.shadows = (_Shadow(count, False), _Shadow(count, True)) if self.adaptive else ()
        self.score = 0  # > 0: the LRU copy matched more; < 0: the bimodal one

    @property
    def bimodal(self) -> bool:
        """Whether the bimodal rule is ahead: eviction then follows its copy."""
        return self.score < 0

    def observe(self, candidates: list[bytes]) -> None:
        """A lookup of a new sequence's snapshot points, longest prefix first: score the two rules by which
        copy holds the longer one. Call before :meth:`find`."""
        if self.adaptive and candidates:
            lru, bimodal = (s.longest(candidates) for s in self.shadows)
            self.score = max(-DUEL_LIMIT, min(DUEL_LIMIT, self.score + (lru > bimodal) - (bimodal > lru)))

    def find(self, prefix_hash: bytes) -> int | None:
        row = self.rows.get(prefix_hash)
        if row is not None:
            self.rows.move_to_end(prefix_hash)
        return row

    def take(self, prefix_hash: bytes) -> int | None:
        """A row for a new snapshot of ``prefix_hash`` (evicting the least recently used), or None when the
        prefix already has one (or the pool has no rows)."""
        if self.count == 0:
            return None
        for shadow in self.shadows:
            shadow.insert(prefix_hash)
        if prefix_hash in self.rows:
            self.rows.move_to_end(prefix_hash)
            return None
        if self.free:
            row = self.free.pop()
        else:
            old = self._victim()
            row = self.rows.pop(old)
            self.num_evicted += 1
            if self.on_evict is not None:
                self.on_evict(row, old)
        self.rows[prefix_hash] = row
        return row

    def _victim(self) -> bytes:
        """The snapshot to evict: the least recently used one that the leading rule's copy no longer holds (so
        the pool's content moves toward that copy's), else the least recently used."""
        if self.adaptive:
            keep = self.shadows[self.bimodal].keys
            for key in self.rows:
                if key not in keep:
                    return key
        return next(iter(self.rows))

    def __len__(self) -> int:
        return len(self.rows)
