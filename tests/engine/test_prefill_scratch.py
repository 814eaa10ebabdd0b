"""The prefill transients the cache plan sets aside: the DSA indexer's bounded varlen scratch and absorbed MLA's
fp32 query and latent output for a full chunk of rows, taken from the memory budget before the pools are
sized, and recorded in the plan."""
from __future__ import annotations

import json

from dayzero import LLM
from dayzero.engine import builder
from dayzero.ops.indexer import triton_indexer
from tests.conftest import CONFIGS


def test_scratch_is_counted_and_taken_from_the_budget(tiny_ckpt, monkeypatch):
    cfg = json.loads((CONFIGS / "dayzero-tiny.json").read_text())
    rows, keys = 256, 1024
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", num_cache_blocks=16)
    H, R, P = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    want = triton_indexer.scratch_bytes(rows, keys, cfg["index_topk"]) + rows * H * (2 * R + P) * 4
    assert builder.prefill_scratch_bytes(llm.engine.model, rows, keys) == want

    monkeypatch.setattr(builder, "available_memory", lambda device: 24 << 20)
    kw = dict(device="cpu", dtype="float32", max_model_len=keys, max_num_batched_tokens=rows, cache_memory_fraction=1.0)
    plan = LLM(str(tiny_ckpt), **kw).engine.cache_plan
    assert plan.scratch_bytes == want
    monkeypatch.setattr(builder, "prefill_scratch_bytes", lambda *a: 0)
    roomier = LLM(str(tiny_ckpt), **kw).engine.cache_plan
    assert plan.num_blocks * plan.bytes_per_block <= 24 * 2**20 - want
    assert roomier.num_blocks > plan.num_blocks
