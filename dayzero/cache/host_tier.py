"""The prefix cache's second tier, in host memory: what the device evicts goes there, and comes back on a hit.

When an allocation evicts a cached block (no sequence holds it, its prefix hash names it), or a new snapshot
evicts the least recently used one, its rows are copied into a pinned host pool instead of being lost, keyed
by the same prefix-cache key. A later request whose prefix the device no longer has but the host does takes a
fresh device block (or snapshot row) and the rows are copied back before its first step; from then on it is
an ordinary device hit. Each tier is least-recently-used on its own.

:class:`HostTier` is the bookkeeping (key -> host row, LRU, counters); :class:`HostCopies` holds the pinned host
mirrors of the device's paged and state tensors and queues the copies, which the host never waits for.

On a GPU the copies run on a stream of their own, beside the steps, and each waits only for what it must:

- a block's rows (small: a block of tokens) wait for every step queued before them (the step in flight may still
  be writing a block its sequence gave back), and the next step waits for them before it runs;
- a snapshot's rows (a model's whole recurrent state, megabytes) wait only for the last state copy on the compute
  stream that touched that row (:meth:`HostCopies.states_copied`), and the compute stream waits for them only
  before its next state copy into or out of that row (:meth:`HostCopies.before_states`). A snapshot going to the
  host overlaps with the next step; one coming back overlaps with the step in flight, and the restore that
  reads it waits for it.

Host rows need no events: every copy into or out of them is on the one copy stream, in order. On a CPU the
copies are plain copies.
"""
from __future__ import annotations

import contextlib

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
    tensors ([rows, ...]), ``blocks`` and ``snapshots`` rows of them, and the copies between the two, on a copy
    stream of their own on a GPU (the module's docstring says which waits keep them ordered)."""

    def __init__(self, block_tensors: list[torch.Tensor], state_tensors: list[torch.Tensor], blocks: int,
                 snapshots: int):
        self.block_tensors, self.state_tensors = block_tensors, state_tensors
        self.blocks, self.snapshots = blocks, snapshots
        device = next((t.device for t in block_tensors + state_tensors if t.device.type == "cuda"), None)
        self.pin = device is not None
        self.stream = torch.cuda.Stream(device) if device is not None and (blocks or snapshots) else None
        self.host_blocks = [self._host(t, blocks) for t in block_tensors] if blocks else []
        self.host_states = [self._host(t, snapshots) for t in state_tensors] if snapshots else []
        self.blocks_moved = None  # copy-stream event after the last block copy the next step has not waited for
        self.row_moved: dict[int, torch.cuda.Event] = {}  # state row -> copy-stream event after its last copy
        self.row_touched: dict[int, torch.cuda.Event] = {}  # state row -> compute-stream event after its last use

    def _host(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=self.pin)

    @staticmethod
    def bytes_per_row(tensors: list[torch.Tensor]) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def _move(self, devs, hosts, dev_row: int, host_row: int, out: bool, after=None) -> "torch.cuda.Event | None":
        """Copy one row each way; on a GPU on the copy stream, after ``after`` (an event; "all": everything
        queued on the current stream), returning the copy stream's event after it."""
        gpu = self.stream is not None
        if gpu and after == "all":
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        elif gpu and after is not None:
            self.stream.wait_event(after)
        with torch.cuda.stream(self.stream) if gpu else contextlib.nullcontext():
            for dev, host in zip(devs, hosts):
                dst, src = (host[host_row], dev[dev_row]) if out else (dev[dev_row], host[host_row])
                dst.copy_(src, non_blocking=gpu)
            if not gpu:
                return None
            done = torch.cuda.Event()
            done.record()
        return done

    def block_out(self, block: int, row: int) -> None:
        self.blocks_moved = self._move(self.block_tensors, self.host_blocks, block, row, out=True, after="all")

    def block_in(self, row: int, block: int) -> None:
        self.blocks_moved = self._move(self.block_tensors, self.host_blocks, block, row, out=False, after="all")

    def snapshot_out(self, state_row: int, row: int) -> None:
        self._row_moved(state_row, self._move(self.state_tensors, self.host_states, state_row, row, out=True,
                                              after=self.row_touched.pop(state_row, None)))

    def snapshot_in(self, row: int, state_row: int) -> None:
        self._row_moved(state_row, self._move(self.state_tensors, self.host_states, state_row, row, out=False,
                                              after=self.row_touched.pop(state_row, None)))

    def _row_moved(self, state_row: int, done) -> None:
        if done is not None:
            self.row_moved[state_row] = done

    # --- the compute stream's side ---------------------------------------------------------------------------
    def before_step(self) -> None:
        """The next step reads and writes blocks: it waits for their copies."""
        if self.blocks_moved is not None:
            torch.cuda.current_stream(self.stream.device).wait_event(self.blocks_moved)
            self.blocks_moved = None

    def before_states(self, rows) -> None:
        """A state copy on the compute stream is about to read or write ``rows``: it waits for their copies."""
        for r in rows:
            done = self.row_moved.pop(r, None)
            if done is not None:
                torch.cuda.current_stream(self.stream.device).wait_event(done)

    def states_copied(self, rows) -> None:
        """A state copy into or out of ``rows`` was queued on the compute stream: their next host copy waits for it."""
        if self.stream is None or not self.snapshots:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.stream.device))
        for r in rows:
            self.row_touched[r] = done
