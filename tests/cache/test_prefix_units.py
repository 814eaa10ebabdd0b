"""The prefix cache's parts on their own: hash chains, cached blocks and their eviction, snapshot rows, and what
a new sequence may reuse and where chunks must end."""
from __future__ import annotations

import pytest

from dayzero.cache.block_pool import BlockPool
from dayzero.cache.manager import CacheManager
from dayzero.cache.prefix import SnapshotPool, block_hashes


def test_hash_chain_names_the_whole_prefix():
    a = block_hashes(list(range(12)), 4, 3, [])
    b = block_hashes(list(range(12)), 4, 3, [])
    c = block_hashes([99] + list(range(1, 12)), 4, 3, [])  # one token differs in the first block
    assert a == b and len(set(a)) == 3
    assert all(x != y for x, y in zip(a, c))  # every later block's name changes with it
    known = block_hashes(list(range(12)), 4, 1, [])
    assert block_hashes(list(range(12)), 4, 3, known) == a  # extends what is known


def test_eviction_takes_only_unheld_cached_blocks_least_recent_first():
    pool = BlockPool(6)  # blocks 1..5
    held = pool.allocate(2)
    cached = pool.allocate(3)
    for b, key in zip(held + cached, [b"h1", b"h2", b"c1", b"c2", b"c3"]):
        pool.register(b, key)
    pool.release(cached)  # cached, unheld: evictable, still found
    assert pool.num_free == 3 and all(pool.lookup(k) is not None for k in (b"c1", b"c2", b"c3"))
    pool.acquire(pool.lookup(b"c3"))  # a hit takes one back
    got = pool.allocate(2)  # nothing free: the two least recently released cached blocks
    assert set(got).isdisjoint(held) and pool.lookup(b"c3") is not None
    assert pool.num_free == 0 and pool.num_evicted == 2
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.lookup(b"h1") == held[0]  # held blocks are never evicted


def test_snapshot_rows_are_reused_least_recent_first():
    snaps = SnapshotPool(first=5, count=2)
    r1, r2 = snaps.take(b"a"), snaps.take(b"b")
    assert {r1, r2} == {5, 6} and snaps.take(b"a") is None  # a prefix keeps its one snapshot
    snaps.find(b"a")  # a used again: b is now the least recent
    assert snaps.take(b"c") == r2 and snaps.find(b"b") is None and snaps.find(b"a") == r1


def manager(states: bool, **kw) -> CacheManager:
    return CacheManager(4, 64, 4, uses_slots=states, prefix_caching=True, snapshot_interval=8,
                        num_snapshots=8 if states else 0, **kw)


def run(cm: CacheManager, seq_id: int, tokens: list[int], prompt_len: int, budget: int = 8) -> None:
    """A sequence computing ``tokens`` chunk by chunk as the scheduler would cut them (at most ``budget`` tokens
    a step), then released."""
    done = cm.match(seq_id, tokens)
    while done < len(tokens):
        n = cm.chunk_end(done, min(budget, len(tokens) - done), prompt_len)
        assert cm.grow(seq_id, done + n)
        done += n
        if (snap := cm.commit(seq_id, tokens, done, prompt_len)) is not None:
            cm.snapshots_copied([snap])  # the runner's copy, queued
    cm.release(seq_id)


@pytest.mark.parametrize("length,want", [(5, 4), (8, 4), (9, 8), (13, 12), (16, 12), (17, 16), (30, 28)])
def test_without_states_any_block_of_the_shared_prefix(length, want):
    cm = manager(states=False)
    run(cm, 0, list(range(40)), 40)
    assert cm.match(1, list(range(length))) == want  # at least one token is left to compute


@pytest.mark.parametrize("length,want", [(5, 0), (8, 0), (9, 8), (17, 16), (24, 16), (25, 24), (35, 32), (37, 36),
                                         (40, 36)])
def test_with_states_only_up_to_the_last_snapshot(length, want):
    cm = manager(states=True)
    run(cm, 0, list(range(37)), 37)  # snapshots at 8, 16, 24, 32 (every 8) and 36 (the prompt's own point)
    assert cm.match(1, list(range(length))) == want


@pytest.mark.parametrize("length", [24, 25, 27])
def test_the_same_prompt_again_resumes_from_its_own_snapshot(length):
    """The prompt's own point is the last aligned one short of its end: a prompt of whole blocks, asked again,
    resumes a block before its end (the snapshot at its end could never be used: a token is always computed)."""
    cm = CacheManager(4, 64, 4, prefix_caching=True, snapshot_interval=512, num_snapshots=4)
    run(cm, 0, list(range(length)), length)
    assert cm.match(1, list(range(length))) == (length - 1) // 4 * 4


def test_the_least_recent_snapshot_goes_first():
    cm = CacheManager(4, 64, 4, prefix_caching=True, snapshot_interval=8, num_snapshots=2)
    run(cm, 0, list(range(30)), 30)  # points 8, 16, 24, 28: only the last two are kept
    assert cm.match(1, list(range(20))) == 0 and cm.match(2, list(range(26))) == 24


def test_chunks_end_at_snapshot_points_and_the_prompt_end():
    cm = manager(states=True)  # interval 8, prompt of 30 tokens: its aligned end is 28
    assert [cm.chunk_end(s, 8, 30) for s in (0, 5, 8, 27)] == [8, 3, 8, 1]  # 8, 16, 24 and the prompt's 28
    assert [cm.chunk_end(s, 20, 30) for s in (0, 5, 16)] == [16, 19, 12]  # the last point in reach; the prompt's
    assert cm.chunk_end(0, 5, 30) == 5  # no point in reach: the whole budget
    assert cm.chunk_end(28, 99, 30) == 120 - 28  # past the prompt's end: the last interval point in reach
    assert cm.chunk_end(0, 16384, 10**6) == 16384  # a long prompt goes in steps of the whole budget
    plain = manager(states=False)
    assert plain.chunk_end(0, 100, 30) == 100  # no states, no snapshot points


def test_a_whole_budget_chunk_keeps_its_snapshots():
    """Chunks of 20 tokens stop at 16 and at the prompt's 28: a prefix hit resumes from either, not from 8."""
    cm = manager(states=True)
    run(cm, 0, list(range(30)), 30, budget=20)
    assert [cm.match(i + 1, list(range(n))) for i, n in enumerate((12, 20, 30))] == [0, 16, 28]


def test_compressed_rows_align_the_reuse_to_their_stride():
    """A paged row per 8 tokens: reuse in whole 8-token units, each keyed by the unit's last prefix."""
    cm = manager(states=False, align=8)
    run(cm, 0, list(range(40)), 40)
    assert cm.match(1, list(range(15))) == 8 and cm.match(2, list(range(30))) == 24
    other = list(range(12)) + [99] * 10  # agrees with block 2 but not with the rest of its unit
    assert cm.match(3, other) == 8


def test_a_failed_start_gives_the_matched_blocks_back():
    cm = manager(states=False)
    run(cm, 0, list(range(20)), 20)
    free = cm.blocks.num_free
    assert cm.match(1, list(range(20))) == 16 and cm.blocks.num_free == free - 4
    cm.release(1)
    assert cm.blocks.num_free == free


def test_a_retried_lookup_scores_the_eviction_rules_once(monkeypatch):
    """A waiting sequence is matched again each time the scheduler retries it; only its first lookup is a
    lookup of the workload, so only it scores the two eviction rules and teaches their copies its keys."""
    cm = CacheManager(4, 64, 4, uses_slots=True, prefix_caching=True, snapshot_interval=8, num_snapshots=4)
    calls = {"blocks": 0, "snapshots": 0}
    monkeypatch.setattr(cm.blocks, "observe", lambda *a, **k: calls.__setitem__("blocks", calls["blocks"] + 1))
    monkeypatch.setattr(cm.snapshots, "observe", lambda *a, **k: calls.__setitem__("snapshots", calls["snapshots"] + 1))
    prompt = list(range(3, 40))
    for _ in range(3):  # admitted, cannot start, released: and again
        cm.match(7, prompt)
        cm.release(7)
    assert calls == {"blocks": 1, "snapshots": 1}
    cm.match(8, prompt)  # another sequence is another lookup
    assert calls == {"blocks": 2, "snapshots": 2}
