"""Sizing the cache pools from a memory budget.

Paged layers share one block table per sequence, so one block costs ``block_size`` tokens of every paged
layer; each running sequence also holds one state slot covering every linear-attention layer (plus the
reserved null slot that padding rows of a captured decode step use). Slots are
sized for ``max_num_seqs``; blocks take the rest of the budget, capped at what ``max_num_seqs`` sequences
of ``max_model_len`` tokens could ever use. When not even one maximum-length sequence fits, loading
stops with the bytes needed, the bytes available and the settings that change either.
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

    @property
    def total_bytes(self) -> int:
        # the state tensors hold the slots, the reserved null slot and the prefix-cache snapshots
        return self.num_blocks * self.bytes_per_block + self.state_rows * self.bytes_per_slot

    @property
    def state_rows(self) -> int:
        return self.num_slots + 1 + self.num_snapshots

    @property
    def capacity_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size if self.bytes_per_block else 1 << 62


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
) -> CachePlan:
    """``num_snapshots``: state snapshots wanted for prefix caching; with a budget they get what is left once
    one maximum-length sequence fits with every slot, down to none (they only save recomputation).
    ``spare_snapshots``: up to this many more, only from budget the blocks leave unused (they are capped at
    what ``max_num_seqs`` sequences of ``max_model_len`` tokens could hold)."""
    per_block = math.ceil(block_size * sum(s.bytes_per_token(kv_cache_dtype, block_size, index_cache_dtype) for s in specs if isinstance(s, PagedSpec)))
    per_slot = sum(s.bytes_per_seq() for s in specs if isinstance(s, StateSpec))
    blocks_per_seq = -(-max_model_len // block_size) if per_block else 0
    snaps = num_snapshots if per_slot else 0
    if num_cache_blocks is not None:
        return CachePlan(block_size, num_cache_blocks, max_num_seqs, per_block, per_slot, num_snapshots=snaps)
    need_one = (1 + blocks_per_seq) * per_block + 2 * per_slot  # a slot, and the null slot
    if budget_bytes is None or budget_bytes < need_one:
        raise CacheMemoryError(
            f"not enough memory for one sequence of max_model_len={max_model_len} tokens: the cache needs "
            f"{_fmt(need_one)} ({need_one} bytes: {blocks_per_seq} blocks of {per_block} bytes + a state slot of "
            f"{per_slot} bytes), {_fmt(budget_bytes or 0)} ({budget_bytes or 0} bytes) is available. "
            f"Lower max_model_len, raise the cache memory (cache_memory_bytes / memory fraction), "
            f"or use a smaller kv_cache_dtype (fp8 or int8)"
        )
    slots = max_num_seqs
    room = budget_bytes - (1 + blocks_per_seq) * per_block  # what one maximum-length sequence leaves
    if per_slot:
        snaps = max(0, min(snaps, room // per_slot - 1 - slots))  # snapshots give way first
    spare = budget_bytes - (slots + 1 + snaps) * per_slot
    if spare < (1 + blocks_per_seq) * per_block:  # fewer slots, so that one full sequence still fits
        slots = max(1, room // max(per_slot, 1) - 1)
        spare = budget_bytes - (slots + 1) * per_slot
    cap = 1 + max_num_seqs * blocks_per_seq
    num_blocks = max(int(min(cap, spare // per_block) if per_block else 1), 2)
    slots = int(min(slots, max_num_seqs))
    if per_slot and spare_snapshots > 0:  # memory the capped blocks leave: more snapshots, never fewer blocks
        unused = budget_bytes - num_blocks * per_block - (slots + 1 + snaps) * per_slot
        snaps += max(0, min(spare_snapshots, unused // per_slot))
    return CachePlan(block_size, num_blocks, slots, per_block, per_slot, num_snapshots=int(snaps))
