"""Which snapshot or cached block the pools evict: least recently used for conversations, as the bimodal rule
would when prompts come back in a cycle longer than the pool, whichever would have resumed more."""
from __future__ import annotations

import pytest

from dayzero.cache.eviction import DUEL_LIMIT
from dayzero.cache.prefix import SnapshotPool


def ask(pool: SnapshotPool, key: bytes) -> bool:
    """A new sequence's lookup of ``key``; on a miss it computes the prefix and snapshots it."""
    pool.observe([key])
    if pool.find(key) is not None:
        return True
    pool.take(key)
    return False


def cycle_hits(policy: str, count: int = 16, distinct: int = 48, passes: int = 4) -> list[int]:
    pool = SnapshotPool(1, count, policy)
    keys = [b"prompt %d" % i for i in range(distinct)]
    return [sum(ask(pool, k) for k in keys) for _ in range(passes)]


def test_a_cycle_longer_than_the_pool_keeps_part_of_it():
    assert cycle_hits("lru") == [0, 0, 0, 0]  # every snapshot is evicted just before it is asked for
    first, second, *later = cycle_hits("adaptive")
    # the first pass has no hits to score the rules by, the second moves the pool to the bimodal copy's content;
    # from then on most of the 16 rows hit (one churns, and one new snapshot in 32 displaces an old one)
    assert first == 0 and all(h >= 12 for h in later)


def conversation_hits(pool: SnapshotPool, users: int = 8, turns: int = 10) -> int:
    """Each user's turn resumes from the snapshot at the end of its previous prompt, and takes a new one."""
    hits = 0
    for t in range(turns):
        for u in range(users):
            prev, nxt = b"user %d turn %d" % (u, t), b"user %d turn %d" % (u, t + 1)
            pool.observe([prev])
            hits += pool.find(prev) is not None
            pool.take(nxt)
    return hits


@pytest.mark.parametrize("after_a_cycle", [False, True])
def test_conversations_stay_least_recently_used(after_a_cycle):
    lru, adaptive = SnapshotPool(1, 16, "lru"), SnapshotPool(1, 16, "adaptive")
    if after_a_cycle:
        for pool in (lru, adaptive):
            for _ in range(2):
                for i in range(48):
                    ask(pool, b"prompt %d" % i)
        assert adaptive.duel.bimodal and lru.duel is None
    got, want = conversation_hits(adaptive), conversation_hits(lru)
    assert want == 72  # every turn after the first
    # it follows LRU from the start, or switches back within a turn of users once the score turns
    assert got == want if not after_a_cycle else got >= want - 2 * DUEL_LIMIT
    assert not adaptive.duel.bimodal


def test_the_lookup_scores_the_longest_prefix_each_rule_would_hold():
    pool = SnapshotPool(1, 2, "adaptive")
    pool.take(b"a")
    pool.observe([b"c", b"b", b"a"])  # both copies hold only a: no preference
    assert pool.duel.score == 0
    for key in (b"b", b"c", b"d"):
        pool.take(key)  # LRU holds c, d; bimodal keeps a and the latest churn, d
    pool.observe([b"c", b"a"])
    assert pool.duel.score == 1 and not pool.duel.bimodal  # LRU would have resumed from c, further than a
    pool.observe([b"e", b"a"])
    pool.observe([b"f", b"a"])  # only the bimodal copy holds a
    assert pool.duel.score == -1 and pool.duel.bimodal
    pool.find(b"d")  # d used again: c is the least recently used
    pool.take(b"g")  # the bimodal copy now holds a and g: of the rows it no longer holds, c goes first
    assert set(pool.rows) == {b"d", b"g"}


def test_an_unknown_policy_is_refused():
    from dayzero.engine.engine import EngineConfig

    with pytest.raises(ValueError, match="adaptive"):
        SnapshotPool(1, 4, "fifo")
    with pytest.raises(ValueError, match="prefix_eviction_policy must be one of"):
        EngineConfig(device="cpu", prefix_eviction_policy="fifo")


@pytest.mark.parametrize("blocks,snapshots", [(256, 4), (40, 64)], ids=["few-snapshots", "few-blocks"])
def test_cycled_prompts_through_the_engine_hit_and_give_the_uncached_output(tiny_ckpt, blocks, snapshots):
    """Twelve distinct prompts asked three times over, one at a time, through four snapshot rows (or 39 blocks,
    for 72 blocks of prompts): the adaptive pools resume some of them where LRU resumes none, and both give the
    uncached tokens and log-probabilities."""
    import torch

    from dayzero import LLM, SamplingParams

    prompts = [torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(12)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=1)
    runs = {}
    for name, kw in {"off": dict(enable_prefix_caching=False), "lru": dict(prefix_eviction_policy="lru"),
                     "adaptive": {}}.items():
        engine = LLM(str(tiny_ckpt), device="cpu", dtype="float32", load_format="dummy", block_size=4,
                     max_num_seqs=1, max_model_len=64, num_cache_blocks=blocks, num_prefix_snapshots=snapshots, **kw)
        outs = [engine.generate([{"prompt_token_ids": p}], sp)[0].outputs[0] for _ in range(3) for p in prompts]
        runs[name] = ([o.token_ids for o in outs], [o.logprobs for o in outs],
                      engine.engine.cache_usage()["prefix_hit_tokens"])
    assert runs["off"][2] == runs["lru"][2] == 0  # everything evicted just before its prompt came back
    assert runs["adaptive"][2] >= 2 * 20  # at least two of the 24 repeats resumed from a 20-token snapshot
    for name in ("lru", "adaptive"):
        assert runs[name][0] == runs["off"][0]
        torch.testing.assert_close(torch.tensor(runs[name][1]), torch.tensor(runs["off"][1]), rtol=1e-5, atol=1e-5)


def prompt_through(pool, keys: list[bytes], group=None) -> int:
    """A sequence (``group``) of these block keys: takes the cached ones from the first on, computes and
    registers the rest, then releases all; returns the blocks it found cached."""
    pool.observe(keys, group)
    held = []
    for key in keys:
        block = pool.lookup(key)
        if block is None:
            break
        pool.acquire(block)
        held.append(block)
    new = pool.allocate(len(keys) - len(held))
    for block, key in zip(new, keys[len(held):]):
        pool.register(block, key, group)
    pool.release(held + new)
    return len(held)


def test_cached_blocks_of_a_cycle_longer_than_the_pool():
    """96 blocks of prompts through 40: LRU finds none of them again; the adaptive pool, from the third pass on,
    a third; and a conversation afterwards gets within two turns of users of LRU's hits. Each prompt is a
    sequence of its own (its blocks a group), as the engine registers them."""
    from dayzero.cache.block_pool import BlockPool

    prompts = [[b"p%d-%d" % (p, j) for j in range(8)] for p in range(12)]
    hits = {}
    for policy in ("lru", "adaptive"):
        pool, seq = BlockPool(41, policy), iter(range(10**6))
        hits[policy] = [sum(prompt_through(pool, keys, next(seq)) for keys in prompts) for _ in range(4)]
        chats = [[b"u%d-0" % u] for u in range(4)]
        total = 0
        for _ in range(10):
            for u, keys in enumerate(chats):
                keys.append(b"u%d-%d" % (u, len(keys)))
                total += prompt_through(pool, keys, next(seq))
        hits[policy].append(total)
        assert pool.num_used == 0 and pool.num_free == 40  # nothing held, nothing lost
    assert hits["lru"][:4] == [0, 0, 0, 0]
    assert hits["adaptive"][:2] == [0, 0] and min(hits["adaptive"][2:4]) >= 24
    assert hits["adaptive"][4] >= hits["lru"][4] - 2 * 4 * 8  # two turns of four users, at most 8 blocks each


def test_copies_count_only_the_room_sequences_leave():
    """While sequences hold blocks they are still filling, the pool caches fewer entries than it has blocks: the
    copies shrink to that room before a victim is chosen, so the leading rule's own choice of what to drop is
    evicted, not the pool's least recently used entry (which, under the bimodal rule, is a kept prompt)."""
    from dayzero.cache.block_pool import BlockPool

    pool = BlockPool(41, "adaptive")
    held = pool.allocate(10)  # a sequence filling 10 blocks
    for p in range(5):  # 30 cached blocks: the pool is full
        new = pool.allocate(6)
        for b, j in zip(new, range(6)):
            pool.register(b, b"p%d-%d" % (p, j), group=p)
        pool.release(new)
    pool.allocate(6)  # six more: before each victim the copies drop, by their own rule, to what still fits
    assert all(len(c.keys) <= 40 - 10 - 5 for c in pool.duel.copies)  # room when the sixth was chosen
    pool.release(held)


@pytest.mark.parametrize("prompts,blocks,capacity,least", [(48, 8, 120, 96), (48, 10, 299, 250)], ids=str)
def test_whole_prompts_of_a_cycle_stay_as_many_as_the_pool_holds(prompts, blocks, capacity, least):
    """Prompts of several blocks each, cycled through a pool of a quarter or 60% of them: from the third pass on
    the adaptive pool finds at least ``least`` blocks a pass, most of what its ``capacity`` can hold, because the
    bimodal rule keeps or drops a sequence's blocks together and the pool evicts what that rule dropped however
    many kept blocks come before it in least-recently-used order (here up to 120). The keys the copies dropped
    are only ever ones the pool still caches."""
    from dayzero.cache.block_pool import BlockPool

    keys = [[b"p%d-%d" % (p, j) for j in range(blocks)] for p in range(prompts)]
    pool, seq = BlockPool(capacity + 1, "adaptive"), iter(range(10**6))
    hits = [sum(prompt_through(pool, k, next(seq)) for k in keys) for _ in range(5)]
    assert hits[0] == 0 and min(hits[2:]) >= least, hits
    assert pool.duel.bimodal and pool.num_used == 0
    for copy in pool.duel.copies:
        assert set(copy.dropped) <= set(pool.cached)
        assert not set(copy.dropped) & set(copy.keys)
