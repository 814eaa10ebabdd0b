"""The prefix cache's host tier (``host_cache_gib``): blocks and state snapshots the device evicts are kept in host
memory and come back on a hit, bit for bit, so a request whose prefix was pushed out of a small device cache
still skips it, with exactly the outputs of a device that kept everything and of a run with no cache at all;
every block, slot and host row is accounted for afterwards; a bad setting is refused."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.cache.host_tier import HostCopies, HostTier
from dayzero.cache.manager import CacheManager
from dayzero.cache.planner import CacheMemoryError
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


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_snapshot_a_matched_sequence_will_restore_is_not_evicted_by_a_fetch(policy):
    """Sequence A matches prefix P3, whose snapshot is the device's only row; in the same schedule B matches P1,
    whose snapshot only the host has. Fetching it must not evict P3's row before A's restore is queued (it would
    copy P1's states into the row A then restores from); B resumes without a snapshot instead."""
    cm = CacheManager(4, 64, 2, prefix_caching=True, snapshot_interval=8, num_snapshots=1, eviction_policy=policy)
    states = torch.zeros(cm.snapshots.first + 1, 1)  # the null slot, 2 slots, 1 snapshot row
    cm.attach_host_tier(HostCopies([], [states], 0, 4))
    prompts = {n: [n] * 9 for n in (1, 2, 3)}  # one snapshot each, after 8 tokens
    for seq, (n, ids) in enumerate(prompts.items()):
        cm.match(seq, ids)
        cm.grow(seq, 9)
        slot = cm.handle(seq).slot
        states[slot] = n  # the states after the prompt: its number
        snap = cm.commit(seq, ids, 8, 9)
        assert snap is not None and snap[0] == slot
        states[snap[1]] = states[slot]
        cm.snapshots_copied([snap])
        cm.release(seq)
    row = next(iter(cm.snapshots.rows.values()))
    assert states[row].item() == 3 and len(cm.host_snapshots) == 2  # P1 and P2 went to the host
    assert cm.match(10, prompts[3]) == 8 and cm.grow(10, 9)  # A: P3 from the device row
    assert cm.match(11, prompts[1]) == 0  # B: P1's snapshot stays on the host, no row for it now
    (src, slot), = cm.take_restores()
    states[slot] = states[src]
    assert states[slot].item() == 3
    assert cm.snapshots.pinned == {}
    cm.release(10), cm.release(11)
    assert cm.match(12, prompts[1]) == 8  # with no restore pending, P1 comes back from the host
    assert cm.grow(12, 9)
    (src, slot), = cm.take_restores()
    assert states[src].item() == 1


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_a_snapshot_row_taken_in_a_step_is_not_evicted_before_its_copy(policy):
    """Two sequences reach a snapshot point in the same step and the device has one snapshot row: the second
    commit must not evict the row the first one just took (its copy is not queued yet, so the host tier would
    keep the row's old states under the first prefix); it goes without a snapshot. A later eviction sends the
    first prefix's own states to the host, and they come back."""
    cm = CacheManager(4, 64, 3, prefix_caching=True, snapshot_interval=8, num_snapshots=1, eviction_policy=policy)
    states = torch.zeros(cm.snapshots.first + 1, 1)
    cm.attach_host_tier(HostCopies([], [states], 0, 4))
    prompts = {n: [n] * 9 for n in (1, 2, 3, 4)}

    def step(seqs):  # each sequence computes its 8 tokens; the snapshots are copied after the step, as the engine does
        pairs = []
        for n in seqs:
            cm.match(n, prompts[n])
            cm.grow(n, 9)
            states[cm.handle(n).slot] = n
        for n in seqs:
            if (snap := cm.commit(n, prompts[n], 8, 9)) is not None:
                pairs.append(snap)
        for slot, row in pairs:
            states[row] = states[slot]
        cm.snapshots_copied(pairs)
        for n in seqs:
            cm.release(n)
        return pairs

    step([1])  # the row holds prefix 1
    assert len(step([2, 3])) == 1  # 2 evicts 1 (to the host, intact); 3 finds the row taken and waits
    step([4])  # 4 evicts 2: its own states go to the host
    for n in (1, 2):
        assert cm.match(10 + n, prompts[n]) == 8 and cm.grow(10 + n, 9)
        (src, slot), = cm.take_restores()
        states[slot] = states[src]
        assert states[slot].item() == n
        cm.release(10 + n)


def workload(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(0, 256, (30,), generator=g).tolist()
    others = [torch.randint(0, 256, (30,), generator=g).tolist() for _ in range(6)]
    return first, others


def run(ckpt, **kw):
    """A prompt, six unrelated ones that push its blocks and snapshots out of a 40-block device cache, then the
    first conversation's next turn (its prompt, output and three more tokens)."""
    kw = {"num_cache_blocks": 40, "num_prefix_snapshots": 2, "device": "cpu", **kw}
    llm = LLM(str(ckpt), dtype="float32", block_size=4, prefix_snapshot_interval=8, max_num_seqs=2, **kw)
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


def test_a_host_tier_larger_than_the_hosts_memory_is_refused_at_startup(tiny_ckpt):
    """Pinning more than the host has would fail late or take the machine's memory: the engine refuses at
    startup, naming what was asked, what is available and the setting to lower."""
    with pytest.raises(CacheMemoryError, match=r"host_cache_gib asks for 1048576\.00 GiB .* available .*--host-cache-gib"):
        LLM(str(tiny_ckpt), device="cpu", dtype="float32", host_cache_gib=2**20)


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "1", True])
def test_a_bad_host_cache_size_is_refused(bad):
    with pytest.raises(ValueError, match="host_cache_gib"):
        EngineConfig(host_cache_gib=bad)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_copies_on_their_own_stream_keep_the_order_of_the_state_copies():
    """On a GPU a snapshot's rows go to the host and back on a copy stream beside the compute stream: a row's
    copy out waits for the state copy that filled it, a later state copy into the row waits for the copy out, and
    a restore waits for the copy back. Long kernels are queued on the compute stream between them, so a missing
    wait would read or overwrite the row early."""
    rows, width = 8, 4 << 20  # 16 MiB a row: copies long enough to race
    states = torch.zeros(rows, width, device="cuda")
    copies = HostCopies([], [states], 0, 2)
    assert copies.stream is not None and copies.host_states[0].is_pinned()
    busy = torch.randn(4096, 4096, device="cuda")

    def state_copy(pairs, value=None):  # what the runner's copy_states does, with its waits
        flat = [r for p in pairs for r in p]
        copies.before_states(flat)
        for _ in range(20):  # keep the compute stream busy before the copy
            busy @ busy
        for src, dst in pairs:
            states[dst] = states[src] if value is None else value
        copies.states_copied(flat)

    state_copy([(0, 5)], value=1.0)  # a commit fills snapshot row 5
    copies.snapshot_out(5, 0)  # evicted to host row 0
    state_copy([(1, 5)], value=2.0)  # the next commit takes row 5
    copies.snapshot_in(0, 6)  # a hit brings host row 0 back into row 6
    state_copy([(6, 2)])  # and restores it into slot 2
    torch.cuda.synchronize()
    assert bool((states[2] == 1.0).all()) and bool((states[5] == 2.0).all())
    assert bool((copies.host_states[0][0] == 1.0).all())


@cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["", "async"])
def test_a_hit_from_host_memory_on_a_gpu_equals_the_device_cache(tiny_ckpt, overlap):
    """The engine on a GPU, its host copies on their own stream: the turn whose prefix came back from host memory
    gives the tokens of a device that kept everything, log-probabilities within 1e-4 (the two engines' caches
    differ in size, and with them the kernels' splits)."""
    _, kept = run(tiny_ckpt, num_cache_blocks=512, num_prefix_snapshots=64, device="cuda")
    host, restored = run(tiny_ckpt, host_cache_gib=0.01, async_scheduling=overlap, device="cuda")
    assert host.engine.runner.host_copies.stream is not None
    assert restored[0] == kept[0]
    assert max(abs(a - b) for a, b in zip(restored[1], kept[1])) < 1e-4
    u = host.engine.cache_usage()
    assert u["host_hit_blocks"] > 0 and u["host_hit_snapshots"] > 0
    assert_cache_empty(host)
