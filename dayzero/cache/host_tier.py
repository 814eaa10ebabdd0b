"""The prefix cache's second tier, in host memory: what the device evicts goes there, and comes back on a hit.

When an allocation evicts a cached block (no sequence holds it, its prefix hash names it), or a new snapshot
evicts the least recently used one, its rows are copied into a pinned host pool instead of being lost, keyed
by the same prefix-cache key. A later request whose prefix the device no longer has but the host does takes a
fresh device block (or snapshot row) and the rows are copied back before its first step; from then on it is
an ordinary device hit. Each tier is least-recently-used on its own.

:class:`HostTier` is the bookkeeping (key -> host row, LRU, counters); :class:`HostCopies` holds the pinned host
mirrors of the device's paged and state tensors and queues the copies. The copies are non-blocking copies on
the current stream, queued when the cache manager decides them (while the next step is being scheduled): a
block's rows leave before its new owner's first write, and come back before the step that reads them, in
stream order, and the host never waits for them. (They do not overlap with the device's compute on that
stream; on a CPU they are plain copies.)
"""
from __future__ import annotations

import torch

from dayzero.cache.prefix import SnapshotPool


class HostTier(SnapshotPool):
    """Rows 0 .. capacity-1 of a host pool, each holding one evicted entry, by prefix-cache key: the snapshot
    pool's least-recently-used rows, with a way out (:meth:`fetch`) for an entry that goes back to the device."""

    def __init__(self, capacity: int):
        super().__init__(0, max(0, int(capacity)))
        self.num_stored = self.num_fetched = 0

    @property
    def capacity(self) -> int:
        return self.count

    def __contains__(self, key: bytes) -> bool:
        return key in self.rows

    def put(self, key: bytes) -> int | None:
        """A host row to copy an evicted entry into (dropping the least recently stored one when full), or None
        when the tier has no rows or already holds ``key``."""
        row = self.take(key)
        self.num_stored += row is not None
        return row

    def fetch(self, key: bytes) -> int | None:
        """The host row holding ``key``, which leaves the tier; None when it is not here. The row stays out of
        use until :meth:`release` (after its copy back is queued: a later copy into it then runs after, in
        stream order)."""
        row = self.rows.pop(key, None)
        self.num_fetched += row is not None
        return row

    def release(self, row: int) -> None:
        self.free.append(row)


class HostCopies:
    """Pinned host mirrors of the device's block tensors (every paged tensor: [num_blocks, ...]) and state
    tensors ([rows, ...]), ``blocks`` and ``snapshots`` rows of them, and the copies between the two."""

    def __init__(self, block_tensors: list[torch.Tensor], state_tensors: list[torch.Tensor], blocks: int,
                 snapshots: int):
        self.block_tensors, self.state_tensors = block_tensors, state_tensors
        self.blocks, self.snapshots = blocks, snapshots
        self.pin = any(t.device.type == "cuda" for t in block_tensors + state_tensors)
        self.host_blocks = [self._host(t, blocks) for t in block_tensors] if blocks else []
        self.host_states = [self._host(t, snapshots) for t in state_tensors] if snapshots else []

    def _host(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pin)

    @staticmethod
    def bytes_per_row(tensors: list[torch.Tensor]) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def _move(self, devs, hosts, dev_row: int, host_row: int, out: bool) -> None:
        for dev, host in zip(devs, hosts):
            dst, src = (host[host_row], dev[dev_row]) if out else (dev[dev_row], host[host_row])
            dst.copy_(src, non_blocking=self.pin)

    def block_out(self, block: int, row: int) -> None:
        self._move(self.block_tensors, self.host_blocks, block, row, out=True)

    def block_in(self, row: int, block: int) -> None:
        self._move(self.block_tensors, self.host_blocks, block, row, out=False)

    def snapshot_out(self, state_row: int, row: int) -> None:
        self._move(self.state_tensors, self.host_states, state_row, row, out=True)

    def snapshot_in(self, row: int, state_row: int) -> None:
        self._move(self.state_tensors, self.host_states, state_row, row, out=False)
