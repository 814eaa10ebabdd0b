"""The cache plan's prefix-cache snapshots: the ones asked for give way first when memory is short; spare ones
(the engine's default, up to three more a seat) come only from budget the capped blocks leave unused."""
from __future__ import annotations

import torch

from dayzero import LLM
from dayzero.cache.planner import SPARE_SNAPSHOTS_PER_SEAT, plan_cache
from dayzero.cache.spec import PagedSpec, StateSpec

# 16-token blocks of 64 bytes a token (1,024 bytes a block), 4,096 bytes a state slot
SPECS = [PagedSpec({"k": ((32,), torch.bfloat16)}), StateSpec({"s": ((1024,), torch.float32)})]
BLOCK, SLOT = 1024, 4096


def plan(budget: int, snapshots: int = 4, spare: int = 0):
    return plan_cache(SPECS, 16, 256, 4, budget, num_snapshots=snapshots, spare_snapshots=spare)


def test_spare_snapshots_take_only_memory_the_capped_blocks_leave():
    cap = 1 + 4 * 256 // 16  # blocks for four sequences of 256 tokens: 65
    roomy = plan(cap * BLOCK + (4 + 1 + 4) * SLOT + 10 * SLOT + 100, spare=12)
    assert (roomy.num_blocks, roomy.num_slots, roomy.num_snapshots) == (cap, 4, 4 + 10)  # 10 slots' worth unused
    assert plan(cap * BLOCK + (4 + 1 + 4) * SLOT + 100 * SLOT, spare=12).num_snapshots == 4 + 12  # at most spare
    assert plan(cap * BLOCK + (4 + 1 + 4) * SLOT + 100 * SLOT).num_snapshots == 4  # none unless asked
    short = plan(40 * BLOCK + (4 + 1 + 4) * SLOT, spare=12)  # blocks below their cap: every spare byte is theirs
    assert (short.num_blocks, short.num_snapshots) == (40, 4)
    for p in (roomy, short):
        assert p.total_bytes <= cap * BLOCK + (4 + 1 + 4) * SLOT + 10 * SLOT + 100


def test_the_engine_default_adds_spare_snapshots_and_an_explicit_count_is_kept(tiny_ckpt):
    roomy = dict(device="cpu", dtype="float32", max_num_seqs=3, max_model_len=256, cache_memory_bytes=256 * 2**20)
    plan = LLM(str(tiny_ckpt), **roomy).engine.cache_plan
    assert plan.num_snapshots == (1 + SPARE_SNAPSHOTS_PER_SEAT) * 3
    assert LLM(str(tiny_ckpt), **roomy, num_prefix_snapshots=2).engine.cache_plan.num_snapshots == 2
    assert LLM(str(tiny_ckpt), **roomy, enable_prefix_caching=False).engine.cache_plan.num_snapshots == 0
