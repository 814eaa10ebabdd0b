"""Sizing the cache pools from a memory budget.

Paged layers share one block table per sequence, so one block costs ``block_size`` tokens of every paged
layer; each running sequence also holds one state slot covering every linear-attention layer (plus the
reserved null slot that padding rows of a captured decode step use). Slots are
sized for ``max_num_seqs``; blocks take the rest of the budget, capped at what ``max_num_seqs`` sequences
of ``max_model_len`` tokens could ever use. When not even one maximum-length sequence fits, loading
stops with the bytes needed, the bytes available and the settings that change either.

Sliding-window layers (``PagedSpec.window``) hold a block only while their window reads it, so their seats
together hold at most :func:`window_pool_blocks`. When every paged layer is windowed, the one block table is
theirs and a sequence's length no longer bounds its blocks (``CachePlan.window``); when full-attention layers
exist too, the windowed ones get a pool of their own of that size (``CachePlan.window_pool``), and the full
layers' blocks take the rest of the budget.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from dayzero.cache.spec import PagedSpec, StateSpec


class CacheMemoryError(RuntimeError):
    pass


DEFAULT_BLOCK_SIZE = 16
SPARE_SNAPSHOTS_PER_SEAT = 3  # default prefix-cache snapshots beyond one a seat, from memory blocks leave unused
MAX_AUTO_BLOCK_SIZE = 256


def auto_block_size(specs: list[PagedSpec | StateSpec]) -> int:
    """The block size when none is given: 16 tokens, or, when a paged row stands for m > 16 tokens (a compressed
    entry: DeepSeek-V4's HCA pools one row per 128), the least common multiple of those strides, so that such a
    pool holds exactly one row per m tokens instead of one per block (up to 256 tokens)."""
    strides = [m for s in specs if isinstance(s, PagedSpec) for m in s.strides.values()]
    size = math.lcm(DEFAULT_BLOCK_SIZE, *strides)
    return size if max(strides, default=1) > DEFAULT_BLOCK_SIZE and size <= MAX_AUTO_BLOCK_SIZE else DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class CachePlan:
    block_size: int
    num_blocks: int  # including the reserved null block
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    graph_bytes: int = 0  # what the decode and prefill CUDA graphs hold beside the cache (taken from the budget)
    scratch_bytes: int = 0  # transient prefill scratch beside the cache (indexer scores, MLA; from the budget)
    num_snapshots: int = 0  # prefix-cache state snapshots: rows of the state tensors after the slots
    host_blocks: int = 0  # the prefix cache's host tier: evicted blocks and snapshots kept in pinned host memory
    host_snapshots: int = 0
    window: int | None = None  # the block table's layers read only this many newest keys (None: every key)
    window_pool: tuple[int, int, int] | None = None  # windowed layers' own pool: (window, blocks, bytes per block)

    @property
    def total_bytes(self) -> int:
        # the state tensors hold the slots, the reserved null slot and the prefix-cache snapshots
        pool = self.window_pool[1] * self.window_pool[2] if self.window_pool else 0
        return self.num_blocks * self.bytes_per_block + pool + self.state_rows * self.bytes_per_slot

    @property
    def state_rows(self) -> int:
        return self.num_slots + 1 + self.num_snapshots

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size if self.bytes_per_block and self.window is None else 1 << 62


def window_blocks(window: int, block_size: int) -> int:
    """The most blocks the newest ``window`` keys of a sequence lie in (the window may straddle one more)."""
    return -(-(window - 1) // block_size) + 1


def window_pool_blocks(window: int, block_size: int, step_tokens: int, seats: int, blocks_per_seq: int) -> int:
    """The most blocks (with the null block) that ``seats`` sequences hold at once in a block table of layers
    reading ``window`` keys: each the blocks its window reads before a step's first position, and the new
    tokens of two steps of up to ``step_tokens`` tokens in all (an overlapped step is scheduled before the
    previous one's blocks go back), each sequence's possibly straddling a block more; never more than
    ``blocks_per_seq`` a seat (their whole length)."""
    per_seat = window_blocks(window, block_size) + 2
    return 1 + min(seats * blocks_per_seq, seats * per_seat + 2 * -(-step_tokens // block_size))


def block_groups(specs) -> tuple[bool, int | None]:
    """(whether some paged layer reads every key, the widest sliding window of the others or None)."""
    paged = [s for s in specs if isinstance(s, PagedSpec)]
    return any(s.window is None for s in paged), max((s.window for s in paged if s.window is not None), default=None)


def _per_block(specs, block_size: int, kv_cache_dtype: str, index_cache_dtype: str) -> int:
    return math.ceil(block_size * sum(s.bytes_per_token(kv_cache_dtype, block_size, index_cache_dtype) for s in specs))


def available_memory(device: torch.device) -> int:
    """Free bytes the cache may use: free device memory on CUDA, available RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _fmt(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def plan_cache(
    specs: list[PagedSpec | StateSpec],
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    budget_bytes: int | None,
    num_cache_blocks: int | None = None,
    kv_cache_dtype: str = "auto",
    num_snapshots: int = 0,
    index_cache_dtype: str = "auto",
    spare_snapshots: int = 0,
    step_tokens: int | None = None,
    groups: tuple[bool, int | None] | None = None,
) -> CachePlan:
    """``num_snapshots``: state snapshots wanted for prefix caching; with a budget they get what is left once
    one maximum-length sequence fits with every slot, down to none (they only save recomputation).
    ``spare_snapshots``: up to this many more, only from budget the blocks leave unused (they are capped at
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens could hold). ``step_tokens``: the most tokens
    one step schedules (default ``max_model_len``), which sizes sliding-window blocks. ``groups``: the whole
    model's :func:`block_groups` when ``specs`` are one pipeline stage's (every stage keeps the same block tables)."""
    paged = [s for s in specs if isinstance(s, PagedSpec)]
    full, windowed = [s for s in paged if s.window is None], [s for s in paged if s.window is not None]
    has_full, w = groups or block_groups(specs)
    per_slot = sum(s.bytes_per_seq() for s in specs if isinstance(s, StateSpec))
    blocks_per_seq = -(-max_model_len // block_size) if paged else 0
    window = window_pool = cap_blocks = None
    pool_bytes = 0
    if w is not None:
        pool = window_pool_blocks(w, block_size, step_tokens or max_model_len, max_num_seqs, blocks_per_seq)
        if has_full:  # a pool of their own, before the full layers' blocks
            window_pool = (w, pool, _per_block(windowed, block_size, kv_cache_dtype, index_cache_dtype))
            pool_bytes = 0 if num_cache_blocks is not None else pool * window_pool[2]
        else:  # the one block table is theirs: what one sequence holds whatever its length, the pool for all
            window = w
            blocks_per_seq = window_pool_blocks(w, block_size, step_tokens or max_model_len, 1, blocks_per_seq) - 1
            cap_blocks = pool
    per_block = _per_block(windowed if window is not None else full, block_size, kv_cache_dtype, index_cache_dtype)
    snaps = num_snapshots if per_slot else 0
    plan = dict(window=window, window_pool=window_pool)
    if num_cache_blocks is not None:
        return CachePlan(block_size, num_cache_blocks, max_num_seqs, per_block, per_slot, num_snapshots=snaps, **plan)
    need_one = (1 + blocks_per_seq) * per_block + 2 * per_slot + pool_bytes  # a slot, and the null slot
    if budget_bytes is None or budget_bytes < need_one:
        pool_note = f" + the sliding-window layers' pool of {pool_bytes} bytes" if pool_bytes else ""
        raise CacheMemoryError(
            f"not enough memory for one sequence of max_model_len={max_model_len} tokens: the cache needs "
            f"{_fmt(need_one)} ({need_one} bytes: {blocks_per_seq} blocks of {per_block} bytes + a state slot of "
            f"{per_slot} bytes{pool_note}), {_fmt(budget_bytes or 0)} ({budget_bytes or 0} bytes) is available. "
            f"Lower max_model_len, raise the cache memory (cache_memory_bytes / memory fraction), "
            f"or use a smaller kv_cache_dtype (fp8 or int8)"
        )
    budget_bytes -= pool_bytes
    slots = max_num_seqs
    room = budget_bytes - (1 + blocks_per_seq) * per_block  # what one maximum-length sequence leaves
    if per_slot:
        snaps = max(0, min(snaps, room // per_slot - 1 - slots))  # snapshots give way first
    spare = budget_bytes - (slots + 1 + snaps) * per_slot
    if spare < (1 + blocks_per_seq) * per_block:  # fewer slots, so that one full sequence still fits
        slots = max(1, room // max(per_slot, 1) - 1)
        spare = budget_bytes - (slots + 1) * per_slot
    cap = cap_blocks or 1 + max_num_seqs * blocks_per_seq
    num_blocks = max(int(min(cap, spare // per_block) if per_block else 1), 2)
    slots = int(min(slots, max_num_seqs))
    if per_slot and spare_snapshots > 0:  # memory the capped blocks leave: more snapshots, never fewer blocks
        unused = budget_bytes - num_blocks * per_block - (slots + 1 + snaps) * per_slot
        snaps += max(0, min(spare_snapshots, unused // per_slot))
    return CachePlan(block_size, num_blocks, slots, per_block, per_slot, num_snapshots=int(snaps), **plan)
