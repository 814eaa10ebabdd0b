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
Snapshots live in extra rows of the state tensors (after the slots).

Which snapshot to evict adapts to the workload (``policy="adaptive"``, :mod:`dayzero.cache.eviction`): least
recently used for conversations, as bimodal insertion would when prompts come back in a cycle longer than the
pool, whichever would have resumed more.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from dayzero.cache.eviction import POLICIES, EvictionDuel


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


class SnapshotPool:
    """Rows ``first .. first + count - 1`` of every state tensor, each holding the states after one prefix;
    ``policy`` "lru" evicts the least recently used, "adaptive" as :class:`~dayzero.cache.eviction.EvictionDuel`
    says."""

    def __init__(self, first: int, count: int, policy: str = "lru"):
        if policy not in POLICIES:
            raise ValueError(f"snapshot eviction policy must be one of {POLICIES}, got {policy!r}")
        self.first, self.count = first, count
        self.free = list(range(first, first + count))[::-1]
        self.rows: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> row; least recently used first
        self.num_evicted = 0
        self.on_evict = None  # (row, prefix hash) -> None, called before an evicted row is reused
        # row -> pins: rows a restore will still read or a commit's copy has yet to fill, never evicted
        self.pinned: dict[int, int] = {}
        self.duel = EvictionDuel(count, self.rows.__contains__) if policy == "adaptive" and count > 0 else None

    def observe(self, candidates: list[bytes]) -> None:
        """A lookup of a new sequence's snapshot points, longest prefix first: score the two rules by which
        copy holds the longer one. Call before :meth:`find`."""
        if self.duel is not None:
            self.duel.observe_longest(candidates)

    def find(self, prefix_hash: bytes) -> int | None:
        row = self.rows.get(prefix_hash)
        if row is not None:
            self.rows.move_to_end(prefix_hash)
        return row

    def pin(self, row: int) -> None:
        """Keep ``row`` from eviction until :meth:`unpin`: a copy out of it or into it is not queued yet."""
        self.pinned[row] = self.pinned.get(row, 0) + 1

    def unpin(self, row: int) -> None:
        n = self.pinned.pop(row) - 1
        if n:
            self.pinned[row] = n

    def can_take(self) -> bool:
        """Whether :meth:`take` of a new prefix would get a row (a free one, or one it may evict)."""
        return self.count > 0 and (bool(self.free) or len(self.pinned) < len(self.rows))

    def take(self, prefix_hash: bytes) -> int | None:
        """A row for a new snapshot of ``prefix_hash`` (evicting the least recently used), or None when the
        prefix already has one, the pool has no rows, or every row is pinned."""
        if self.count == 0:
            return None
        if self.duel is not None:
            self.duel.insert(prefix_hash)
        if prefix_hash in self.rows:
            self.rows.move_to_end(prefix_hash)
            return None
        if self.free:
            row = self.free.pop()
        else:
            unpinned = lambda k: k if k in self.rows and self.rows[k] not in self.pinned else None  # noqa: E731
            lru = lambda: next((k for k, r in self.rows.items() if r not in self.pinned), None)  # noqa: E731
            old = lru() if self.duel is None else self.duel.victim(unpinned, lru)
            if old is None:
                return None
            row = self.rows.pop(old)
            if self.duel is not None:
                self.duel.forget(old)
            self.num_evicted += 1
            if self.on_evict is not None:
                self.on_evict(row, old)
        self.rows[prefix_hash] = row
        return row

    def __len__(self) -> int:
        return len(self.rows)
