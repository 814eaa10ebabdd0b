"""The cache manager owns blocks, state slots and the prefix cache, and hands the scheduler opaque
per-sequence handles.

The scheduler asks only: how much of a new sequence is already cached (``match``), where its next chunk must
end (``chunk_end``), can this sequence grow to N tokens (``can_grow``), grow it (``grow``), and release it
(``release``); the engine reports each step's progress (``commit``). Tensors and slot arithmetic stay here and
in the model runner, which carries out the state copies this decides (``take_restores``, ``commit``).

Prefix caching (``dayzero.cache.prefix``): a new sequence takes the cached blocks of its longest cached prefix
of full blocks, less at least one token (its logits are sampled), aligned down to ``align`` tokens; when the
model keeps per-sequence states, only up to the last snapshot at or before that, whose states are copied into
the sequence's slot before its first step. Matched lengths are multiples of ``align``: the block size, or a
multiple of it where a paged row stands for several tokens (DeepSeek-V4's compressed entries of m tokens are
complete only at multiples of m, so a shared block never gets an entry written later).

Sliding windows: paged layers whose queries read only the last ``w`` keys need a block only while a position
still to be computed reads it. With ``window`` the block table's layers are all such layers; with
``window_pool`` = (w, blocks) the windowed layers of a model that also has full-attention layers keep their
rows in a pool of their own with a second block table per sequence (``CacheHandle.tables[1]``, the same
length as the first: entry j holds tokens j·block_size ..). Once a sequence has computed n tokens, its blocks
wholly before position n - w + 1 go back to their pool (registered ones stay in the prefix cache, evictable)
and their table entries become the null block, which the windowed kernels never read; a prefix hit takes
from such a pool only the blocks its window reads.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from dayzero.cache.block_pool import NULL_BLOCK, BlockPool, SlotPool
from dayzero.cache.host_tier import HostTier
from dayzero.cache.prefix import SnapshotPool, block_hashes


OBSERVED_KEPT = 4096


@dataclass
class CacheHandle:
    # one block table per block group (the manager's ``groups``); NULL_BLOCK where a window let a block go
    tables: list[list[int]] = field(default_factory=lambda: [[]])
    freed: list[int] = field(default_factory=lambda: [0])  # per group: leading entries given back (null)
    slot: int | None = None
    hashes: list[bytes] = field(default_factory=list)  # prefix hash of each full block, as far as computed
    registered: int = 0  # blocks already offered to the prefix cache
    restore_from: int | None = None  # snapshot row to copy into the slot once it is allocated

    @property
    def blocks(self) -> list[int]:
        """The first group's block table."""
        return self.tables[0]


class CacheManager:
    def __init__(self, block_size: int, num_blocks: int, num_slots: int, uses_blocks: bool = True, uses_slots: bool = True,
                 prefix_caching: bool = False, snapshot_interval: int = 512, num_snapshots: int = 0, align: int | None = None,
                 eviction_policy: str = "adaptive", window: int | None = None,
                 window_pool: tuple[int, int] | None = None):
        self.block_size = block_size
        self.uses_blocks, self.uses_slots = uses_blocks, uses_slots
        # a windowed pool keeps only the tails of prefixes, which the leading rule of the adaptive policy does
        # not model: least recently used
        self.blocks = BlockPool(num_blocks, eviction_policy if prefix_caching and window is None else "lru")
        # (pool, window) per block group: the first one's, then the windowed layers' own pool if they have one
        self.groups: list[tuple[BlockPool, int | None]] = [(self.blocks, window)]
        if window_pool is not None:
            self.groups.append((BlockPool(window_pool[1], "lru"), window_pool[0]))
        self.slots = SlotPool(num_slots)
        self.handles: dict[int, CacheHandle] = {}
        # prefix caching needs blocks to name prefixes by; with states it needs somewhere to keep snapshots
        self.prefix_caching = prefix_caching and uses_blocks and (num_snapshots > 0 or not uses_slots)
        self.align = math.lcm(block_size, align or block_size)
        self.interval = -(-max(snapshot_interval, 1) // self.align) * self.align
        # snapshot rows follow the slots (1 .. num_slots) and the null slot 0 in every state tensor
        self.snapshots = SnapshotPool(num_slots + 1, num_snapshots if self.prefix_caching and uses_slots else 0,
                                      eviction_policy)
        self.pending_restores: list[tuple[int, int]] = []  # (snapshot row, slot) to copy before the next forward
        self.queried_tokens = self.hit_tokens = 0
        # sequences whose lookup already scored the eviction rules (a waiting sequence is matched again each time
        # the scheduler retries it; one request is one lookup), the most recent OBSERVED_KEPT
        self.observed: OrderedDict[int, None] = OrderedDict()
        self.copies = None  # the host tier, once attached: empty tiers until then
        self.host_blocks, self.host_snapshots = HostTier(0), HostTier(0)
        self.host_hit_blocks = self.host_hit_snapshots = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size) if self.uses_blocks else 0

    def capacity_tokens(self) -> int:
        """The longest sequence the blocks can hold (unbounded when every paged layer is windowed)."""
        if self.groups[0][1] is not None:
            return 1 << 62
        return (self.blocks.num_blocks - 1) * self.block_size

    def _new_handle(self) -> CacheHandle:
        return CacheHandle(tables=[[] for _ in self.groups], freed=[0] * len(self.groups))

    def _missing(self, seq_id: int, num_tokens: int) -> tuple[int, int]:
        h = self.handles.get(seq_id)
        have_blocks = len(h.blocks) if h else 0  # every group's table has the same length
        need_slot = int(self.uses_slots and (h is None or h.slot is None))
        return max(0, self.blocks_for(num_tokens) - have_blocks), need_slot

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        nb, ns = self._missing(seq_id, num_tokens)
        return all(nb <= pool.num_free for pool, _ in self.groups) and ns <= self.slots.num_free

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Make sure ``seq_id`` holds cache for ``num_tokens`` tokens; False (nothing taken) if it cannot."""
        if not self.can_grow(seq_id, num_tokens):
            return False
        nb, ns = self._missing(seq_id, num_tokens)
        h = self.handles.get(seq_id)
        if h is None:
            h = self.handles[seq_id] = self._new_handle()
        for (pool, _), table in zip(self.groups, h.tables):
            table += pool.allocate(nb)
        if ns:
            h.slot = self.slots.allocate()
            if h.restore_from is not None:  # a prefix hit: its states come from the snapshot
                self.pending_restores.append((h.restore_from, h.slot))
                h.restore_from = None
        return True

    def release(self, seq_id: int) -> None:
        h = self.handles.pop(seq_id, None)
        if h is None:
            return
        for (pool, _), table in zip(self.groups, h.tables):
            pool.release([b for b in table if b != NULL_BLOCK])
        if h.restore_from is not None:  # matched, never started
            self.snapshots.unpin(h.restore_from)
        if h.slot is not None:
            self.slots.release(h.slot)

    def handle(self, seq_id: int) -> CacheHandle:
        return self.handles[seq_id]

    # --- prefix caching --------------------------------------------------------------------------------
    def match(self, seq_id: int, token_ids: list[int], extra_keys=None) -> int:
        """For a sequence that holds no cache yet: take the cached blocks of the longest prefix it may reuse
        and return that prefix's length (0: nothing). ``release`` undoes it when the sequence cannot start.
        ``extra_keys``: what the blocks' hashes take beyond the token ids (:func:`~dayzero.cache.prefix.block_hashes`)."""
        if not self.prefix_caching or seq_id in self.handles:
            return 0
        bs, step = self.block_size, self.align // self.block_size
        h = self._new_handle()
        hashes = block_hashes(token_ids, bs, (len(token_ids) - 1) // bs // step * step, h.hashes, extra_keys)
        keys = [self._key(hashes, j) for j in range(len(hashes))]
        first = seq_id not in self.observed
        if first:
            self.observed[seq_id] = None
            if len(self.observed) > OBSERVED_KEPT:
                self.observed.popitem(last=False)
        blocks = []  # the first group's, when its layers read every key: each taken as found (fetching one from
        if self.groups[0][1] is None:  # the host tier may evict an unheld block)
            if first:
                self.blocks.observe(keys, seq_id)
            for key in keys:
                b = self.blocks.lookup(key)
                if b is not None:
                    self.blocks.acquire(b)
                elif (b := self._fetch_block(key)) is None:
                    break
                blocks.append(b)
            top = len(blocks) // step * step  # whole aligned units only
        else:
            top = len(keys) // step * step
        k, row = top, None
        if self.uses_slots and first:
            self.snapshots.observe([hashes[j - 1] for j in range(len(hashes) // step * step, 0, -step)])
        while k > 0:  # the longest aligned prefix whose windows are cached, with a snapshot (states) at its end
            if self._windows_cached(keys, k) and (not self.uses_slots
                                                  or (row := self._find_snapshot(hashes[k - 1])) is not None):
                break
            k -= step
        self.blocks.release(blocks[k:])  # past the last aligned unit (or snapshot): cached, unheld again
        if k == 0:
            return 0
        for g, (pool, window) in enumerate(self.groups):
            if window is None:
                h.tables[g] = blocks[:k]
                continue
            lo = self._first_read(k * bs, window)
            h.tables[g] = [NULL_BLOCK] * lo + [pool.lookup(key) for key in keys[lo:k]]
            h.freed[g] = lo
            for b in h.tables[g][lo:]:
                pool.acquire(b)
        h.registered, h.restore_from = k, row
        if row is not None:  # until its copy into the slot is queued, no eviction may reuse it
            self.snapshots.pin(row)
        self.handles[seq_id] = h
        return k * bs

    def _first_read(self, num_tokens: int, window: int) -> int:
        """The first block that a window of ``window`` keys reads from position ``num_tokens`` on."""
        return max(0, num_tokens - window + 1) // self.block_size

    def _windows_cached(self, keys: list[bytes], k: int) -> bool:
        """Whether every windowed group caches the blocks a query after the first k blocks reads."""
        return all(pool.lookup(key) is not None for pool, window in self.groups if window is not None
                   for key in keys[self._first_read(k * self.block_size, window):k])

    def _drop_behind(self, h: CacheHandle, num_computed: int) -> None:
        """A windowed group's blocks that no position from ``num_computed`` on reads go back to their pool."""
        for g, (pool, window) in enumerate(self.groups):
            if window is None:
                continue
            table = h.tables[g]
            dead = min(self._first_read(num_computed, window), len(table))
            if dead > h.freed[g]:
                pool.release([b for b in table[h.freed[g]:dead] if b != NULL_BLOCK])
                table[h.freed[g]:dead] = [NULL_BLOCK] * (dead - h.freed[g])
                h.freed[g] = dead

    # --- the host tier (dayzero.cache.host_tier) ---------------------------------------------------------
    def attach_host_tier(self, copies) -> None:
        """Evicted blocks and snapshots go to ``copies`` (a :class:`HostCopies`, with its rows of each) instead of
        being lost, and come back on a hit."""
        self.copies = copies
        self.host_blocks, self.host_snapshots = HostTier(copies.blocks), HostTier(copies.snapshots)
        self.blocks.on_evict, self.snapshots.on_evict = self._block_evicted, self._snapshot_evicted

    def _block_evicted(self, block: int, key: bytes) -> None:
        row = self.host_blocks.put(key)
        if row is not None:
            self.copies.block_out(block, row)

    def _snapshot_evicted(self, state_row: int, key: bytes) -> None:
        row = self.host_snapshots.put(key)
        if row is not None:
            self.copies.snapshot_out(state_row, row)

    def _fetch_block(self, key: bytes) -> int | None:
        """A device block holding the host tier's rows of ``key`` (held once, registered), or None."""
        if key not in self.host_blocks or self.blocks.num_free == 0:
            return None
        row = self.host_blocks.fetch(key)  # out of the tier first: the allocation below may evict into it
        b = self.blocks.allocate(1)[0]
        self.copies.block_in(row, b)
        self.host_blocks.release(row)
        self.blocks.register(b, key)
        self.host_hit_blocks += 1
        return b

    def _find_snapshot(self, prefix_hash: bytes) -> int | None:
        """The snapshot row of ``prefix_hash`` on the device, fetched from the host tier if only it has one."""
        row = self.snapshots.find(prefix_hash)
        if row is not None or prefix_hash not in self.host_snapshots or not self.snapshots.can_take():
            return row
        host_row = self.host_snapshots.fetch(prefix_hash)
        row = self.snapshots.take(prefix_hash)  # may evict (offload) the least recently used device snapshot
        if row is not None:
            self.copies.snapshot_in(host_row, row)
            self.host_hit_snapshots += 1
        self.host_snapshots.release(host_row)
        return row

    def _key(self, hashes: list[bytes], j: int) -> bytes:
        """The prefix-cache key of block j: the prefix hash at the end of its aligned unit, and j's place in the
        unit. A compressed entry stored in block j may pool tokens of later blocks of the same unit, so the
        block's content is a function of the whole unit's tokens, not only of the tokens up to j."""
        step = self.align // self.block_size
        return hashes[(j // step + 1) * step - 1] + (j % step).to_bytes(4, "little")

    def record_admission(self, prompt_tokens: int, hit_tokens: int) -> None:
        """Count an admitted sequence's tokens and those the prefix cache gave it (hit-rate metrics)."""
        self.queried_tokens += prompt_tokens
        self.hit_tokens += hit_tokens

    def chunk_end(self, start: int, n: int, prompt_len: int) -> int:
        """How many of ``n`` tokens from position ``start`` the next chunk may take: a chunk that reaches a
        snapshot point (every ``interval`` tokens, and the prompt's own point, :meth:`_prompt_point`), where the states
        are copied out, stops at the prompt's point if it reaches it, else at the last interval point it reaches;
        one that reaches none takes all ``n``. So a long prompt
        is prefilled in steps of the whole token budget (rounded down to the interval) with a snapshot after
        each, not in steps of one interval."""
        if not (self.prefix_caching and self.uses_slots):
            return n
        prompt_end = self._prompt_point(prompt_len)
        if start < prompt_end <= start + n:  # the prompt's own snapshot first (a recomputed sequence goes on)
            return prompt_end - start
        end = (start + n) // self.interval * self.interval  # the last interval point in reach
        return end - start if end > start else n

    def _prompt_point(self, prompt_len: int) -> int:
        """A prompt's own snapshot point: its last aligned point short of its end, the furthest that the same
        prompt again (which computes at least its last token) can resume from, and that a longer prompt
        starting with it (the conversation's next turn) can too."""
        return (prompt_len - 1) // self.align * self.align

    def commit(self, seq_id: int, token_ids: list[int], num_computed: int, prompt_len: int,
               extra_keys=None) -> tuple[int, int] | None:
        """After a step brought ``seq_id`` to ``num_computed`` tokens: its full blocks join the prefix cache, and
        at a snapshot point returns (slot, snapshot row) for the runner to copy the states into, then to report
        with :meth:`snapshots_copied`."""
        h = self.handles.get(seq_id)
        if h is None:  # released while the step ran (preempted, aborted)
            return None
        if not self.prefix_caching:
            self._drop_behind(h, num_computed)
            return None
        # a block is complete only below an aligned point: a compressed entry stored in it (a window that starts
        # there) may be written m tokens after the block's own tokens are in; registering earlier could let a
        # sequence that stopped before writing it hand the block to the prefix cache without the entry
        full = min(num_computed // self.align * self.align // self.block_size, len(h.blocks))
        hashes = block_hashes(token_ids, self.block_size, full, h.hashes, extra_keys)
        for i in range(h.registered, full):
            key = self._key(hashes, i)
            for (pool, _), table in zip(self.groups, h.tables):
                if table[i] != NULL_BLOCK:
                    pool.register(table[i], key, group=seq_id)
        h.registered = max(h.registered, full)
        self._drop_behind(h, num_computed)  # after registering: what goes back stays cached
        at_point = num_computed % self.interval == 0 or num_computed == self._prompt_point(prompt_len)
        if not (self.uses_slots and h.slot is not None and num_computed > 0 and num_computed % self.align == 0 and at_point):
            return None
        row = self.snapshots.take(hashes[num_computed // self.block_size - 1])
        if row is None:
            return None
        # until the runner has queued the copy into it (snapshots_copied), the row holds something else: evicting
        # it now (another commit of this step) would send that to the host tier under this prefix
        self.snapshots.pin(row)
        return h.slot, row

    def snapshots_copied(self, pairs: list[tuple[int, int]]) -> None:
        """The runner queued the copies (slot, snapshot row) that :meth:`commit` returned: their rows may be
        evicted again (a later copy out of them runs after, in stream order)."""
        for _, row in pairs:
            self.snapshots.unpin(row)

    def take_restores(self) -> list[tuple[int, int]]:
        """(snapshot row, slot) copies the runner must make before the next forward pass."""
        out, self.pending_restores = self.pending_restores, []
        for row, _ in out:  # their copies are queued before any later one into these rows
            self.snapshots.unpin(row)
        return out

    def usage(self) -> dict[str, int]:
        return {
            "blocks_total": self.blocks.num_blocks - 1, "blocks_free": self.blocks.num_free,
            "slots_total": self.slots.num_slots, "slots_free": self.slots.num_free,
            "blocks_cached": len(self.blocks.cached), "snapshots": len(self.snapshots),
            **({"window_blocks_total": self.groups[1][0].num_blocks - 1, "window_blocks_free": self.groups[1][0].num_free}
               if len(self.groups) > 1 else {}),
            "prefix_queried_tokens": self.queried_tokens, "prefix_hit_tokens": self.hit_tokens,
            "host_blocks_total": self.host_blocks.capacity, "host_blocks_cached": len(self.host_blocks),
            "host_snapshots_total": self.host_snapshots.capacity, "host_snapshots_cached": len(self.host_snapshots),
            "host_hit_blocks": self.host_hit_blocks, "host_hit_snapshots": self.host_hit_snapshots,
        }
