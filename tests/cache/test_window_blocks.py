"""Sliding-window layers give their blocks back as they fall out of the window.

The expected tables and hits below come from the definition (a query at position p reads keys p - w + 1 .. p,
so block j of b tokens is dead once j·b + b - 1 < n - w + 1), not from the manager's own helpers.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.cache.manager import CacheManager
from dayzero.cache.planner import plan_cache, window_pool_blocks
from dayzero.cache.prefix import block_hashes
from dayzero.cache.spec import PagedSpec

BS, W = 4, 6
ROW = ((2, 8), torch.float32)


def _dead(n: int, window: int = W, bs: int = BS) -> list[int]:
    """Blocks no query at position >= n reads, by the definition."""
    return [j for j in range(-(-n // bs)) if j * bs + bs - 1 < n - window + 1]


def test_blocks_behind_the_window_go_back_and_all_are_accounted():
    cm = CacheManager(BS, 64, 4, uses_slots=False, window_pool=(W, 32))
    full, windowed = cm.groups[0][0], cm.groups[1][0]
    ids = list(range(100, 170))
    for n in range(4, 71, 4):  # decode-like growth, a commit after each step
        assert cm.grow(1, n)
        cm.commit(1, ids, n, 70)
        h = cm.handle(1)
        dead = _dead(n)
        assert [j for j, b in enumerate(h.tables[1]) if b == 0] == dead
        assert 0 not in h.tables[0] and len(h.tables[0]) == len(h.tables[1]) == -(-n // BS)
        assert windowed.num_used == len(h.tables[1]) - len(dead) and full.num_used == len(h.tables[0])
    assert windowed.num_used <= 3  # ceil((W - 1) / BS) + 1 live blocks
    cm.release(1)
    assert full.num_free == 63 and windowed.num_free == 31


def test_a_hit_takes_only_the_window_it_reads_and_shrinks_when_that_is_gone():
    cm = CacheManager(BS, 64, 4, uses_slots=False, prefix_caching=True, window_pool=(W, 16))
    windowed = cm.groups[1][0]
    prompt = list(range(7, 28))  # 21 tokens: 5 full blocks may be shared (one token is always computed)
    assert cm.match(1, prompt) == 0 and cm.grow(1, 21)
    a = [list(t) for t in cm.handle(1).tables]  # the blocks it computed into
    cm.commit(1, prompt, 21, 21)
    assert cm.handle(1).tables[1][:4] == [0] * 4  # positions 0 .. 15 are behind the window of 21
    assert cm.match(2, prompt) == 20
    b = cm.handle(2).tables
    assert b[0] == a[0][:5]
    first = (20 - W + 1) // BS  # the first block the window of position 20 reads
    assert b[1][:first] == [0] * first and b[1][first:] == a[1][first:5]
    cm.release(2)
    cm.release(1)


@pytest.mark.parametrize("evict", [1, 2, 4])
def test_a_hit_shrinks_to_the_windows_still_cached(evict):
    cm = CacheManager(BS, 64, 4, uses_slots=False, prefix_caching=True, window_pool=(W, 16))
    full, windowed = cm.groups[0][0], cm.groups[1][0]
    prompt = list(range(7, 28))
    cm.match(1, prompt)
    cm.grow(1, 21)
    cm.commit(1, prompt, 21, 21)
    cm.release(1)  # every block cached and unheld; the full layers' five stay cached
    windowed.allocate(len(windowed.free) + evict)  # evicts `evict` windowed blocks
    hashes = block_hashes(prompt, BS, 5, [])
    cached = [windowed.lookup(cm._key(hashes, j)) is not None for j in range(5)]
    assert cached.count(False) == evict
    # by the definition: the longest k whose window (positions 4k - W + 1 .. 4k - 1) lies in cached blocks
    want = max((k for k in range(1, 6) if all(cached[j] for j in range(5) if j < k and j * BS + BS - 1 >= k * BS - W + 1)),
               default=0)
    assert cm.match(2, prompt) == want * BS
    assert full.num_used == want  # the full layers' blocks past the hit went back
    if want:
        assert cm.handle(2).tables[0] == [full.lookup(cm._key(hashes, j)) for j in range(want)]


def test_all_windowed_sequences_outgrow_the_pool():
    cm = CacheManager(BS, 8, 2, uses_slots=False, window=W)  # 7 blocks: 28 tokens of keys at once
    assert cm.capacity_tokens() > 1 << 40
    ids = list(range(400))
    for n in range(1, 401):
        assert cm.grow(1, n), n
        cm.commit(1, ids, n, 400)
    assert cm.blocks.num_used == -(-400 // BS) - len(_dead(400))
    cm.release(1)
    assert cm.blocks.num_free == 7


def test_plan_sizes_windowed_pools_by_window_not_context():
    full = PagedSpec({"k": ROW, "v": ROW})
    windowed = PagedSpec({"k": ROW, "v": ROW}, window=128)
    per_block = 16 * 2 * 2 * 8 * 4
    # 4 seats: each its window's 8 blocks, one it straddles and two steps' blocks, plus two steps of 256 tokens
    pool = 1 + 4 * (8 + 1 + 2) + 2 * 256 // 16
    assert window_pool_blocks(128, 16, 256, 4, 1 << 16) == pool
    assert window_pool_blocks(128, 16, 256, 4, 10) == 1 + 40  # never more than the seats' whole lengths
    # every paged layer windowed: a 1M-token context fits in what the seats' windows take
    plan = plan_cache([windowed], 16, 1 << 20, 4, pool * per_block, step_tokens=256)
    assert plan.window == 128 and plan.window_pool is None and plan.num_blocks == pool
    assert plan.capacity_tokens > 1 << 40
    # mixed: the windowed layers get their pool, the full ones the rest of the budget
    plan = plan_cache([full, windowed], 16, 4096, 4, 1 << 30, step_tokens=256)
    assert plan.window is None and plan.window_pool == (128, pool, per_block)
    assert plan.num_blocks == 1 + 4 * 4096 // 16  # capped at what 4 seats of 4096 tokens use
    assert plan.total_bytes == plan.num_blocks * per_block + pool * per_block
    tight = plan_cache([full, windowed], 16, 4096, 4, (pool + 300) * per_block, step_tokens=256)
    assert tight.num_blocks == 300
