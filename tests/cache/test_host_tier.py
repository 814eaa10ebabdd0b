"""The prefix cache's host tier (``host_cache_gib``): blocks and state snapshots the device evicts are kept in host
memory and come back on a hit, bit for bit, so a request whose prefix was pushed out of a small device cache
still skips it, with exactly the outputs of a device that kept everything and of a run with no cache at all;
every block, slot and host row is accounted for afterwards; a bad setting is refused."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.cache.host_tier import HostTier
from dayzero.engine.engine import EngineConfig
from tests.engine.test_engine import assert_cache_empty

SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


def test_tier_is_lru_and_keeps_a_fetched_row_until_released():
    t = HostTier(2)
    a, b = t.put(b"a"), t.put(b"b")
    assert {a, b} == {0, 1} and t.put(b"a") is None  # already there (and now the most recent)
    assert t.put(b"c") == b and b"b" not in t and t.num_evicted == 1  # full: the least recent, "b", goes
    row = t.fetch(b"a")
    assert row == a and b"a" not in t and t.fetch(b"a") is None
    assert t.put(b"d") == b  # the fetched row is not free yet (its copy back may still be queued): "c" goes
    t.release(row)
    assert t.put(b"e") == row
    assert (t.num_stored, t.num_fetched) == (5, 1)
    assert HostTier(0).put(b"x") is None


def workload(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 256, (30,), generator=g).tolist()
    others = [torch.randint(0, 256, (30,), generator=g).tolist() for _ in range(6)]
    return first, others


def run(ckpt, **kw):
    """A prompt, six unrelated ones that push its blocks and snapshots out of a 40-block device cache, then the
    first conversation's next turn (its prompt, output and three more tokens)."""
    kw = {"num_cache_blocks": 40, "num_prefix_snapshots": 2, **kw}
    llm = LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, prefix_snapshot_interval=8, max_num_seqs=2, **kw)
    first, others = workload()
    out = llm.generate([{"prompt_token_ids": first}], SP)[0].outputs[0]
    for p in others:
        llm.generate([{"prompt_token_ids": p}], SP)
    turn = llm.generate([{"prompt_token_ids": first + out.token_ids + [5, 6, 7]}], SP)[0].outputs[0]
    return llm, (turn.token_ids, turn.logprobs, turn.top_logprobs)


@pytest.mark.parametrize("overlap", [False, True], ids=["", "async"])
def test_a_hit_from_host_memory_equals_the_device_cache_and_no_cache(tiny_ckpt, overlap):
    _, uncached = run(tiny_ckpt, enable_prefix_caching=False)
    roomy, kept = run(tiny_ckpt, num_cache_blocks=512, num_prefix_snapshots=64)  # nothing evicted
    small, lost = run(tiny_ckpt)  # evicted, no host tier: the turn recomputes its prefix
    host, restored = run(tiny_ckpt, host_cache_gib=0.01, async_scheduling=overlap)
    assert restored == kept  # bit for bit: the rows that came back are the rows the device kept
    assert restored[0] == uncached[0] == lost[0]
    assert max(abs(a - b) for a, b in zip(restored[1], uncached[1])) < 1e-5
    u, u_small, u_roomy = host.engine.cache_usage(), small.engine.cache_usage(), roomy.engine.cache_usage()
    assert u_small["prefix_hit_tokens"] < u["prefix_hit_tokens"] == u_roomy["prefix_hit_tokens"]
    assert u["host_hit_blocks"] > 0 and u["host_hit_snapshots"] > 0
    assert 0 < u["host_blocks_cached"] <= u["host_blocks_total"]
    for tier in (host.engine.cache.host_blocks, host.engine.cache.host_snapshots):  # every host row accounted for
        assert len(tier.rows) + len(tier.free) == tier.capacity
    assert host.engine.cache_plan.host_blocks == u["host_blocks_total"]
    assert_cache_empty(host)


def test_quantised_blocks_come_back_whole(tiny_ckpt):
    """int8 pools keep a scale per block beside the codes: both travel."""
    _, kept = run(tiny_ckpt, num_cache_blocks=512, num_prefix_snapshots=64, kv_cache_dtype="int8")
    host, restored = run(tiny_ckpt, host_cache_gib=0.01, kv_cache_dtype="int8")
    assert restored == kept and host.engine.cache_usage()["host_hit_blocks"] > 0
    assert_cache_empty(host)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True])
def test_a_bad_host_cache_size_is_refused(bad):
    with pytest.raises(ValueError, match="host_cache_gib"):
        EngineConfig(host_cache_gib=bad)
