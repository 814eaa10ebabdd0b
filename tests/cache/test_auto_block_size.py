"""The block size when none is given: 16 tokens, or the stride of compressed rows when larger, so that a pool of
one row per m tokens (DeepSeek-V4's HCA entries) holds exactly that and not one row per 16-token block."""
from __future__ import annotations

import json

from dayzero import LLM, SamplingParams
from dayzero.cache.planner import auto_block_size
from dayzero.cache.spec import PagedSpec
from tests.hf.test_deepseek_v4 import CONFIG, CSA, HCA


def v4_config(tmp_path, hca: int):
    cfg = {**CONFIG, "model_type": "deepseek_v4", "compress_rates": {CSA: 4, HCA: hca}, "max_position_embeddings": 1024}
    path = tmp_path / f"v4-{hca}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_rule():
    row = {"x": ((8,), None)}
    assert auto_block_size([]) == 16
    assert auto_block_size([PagedSpec(row, strides={"x": 4})]) == 16
    assert auto_block_size([PagedSpec(row, strides={"x": 128}), PagedSpec(row, strides={"x": 4})]) == 128
    assert auto_block_size([PagedSpec(row, strides={"x": 48})]) == 48
    assert auto_block_size([PagedSpec(row, strides={"x": 512})]) == 16  # past 256 tokens a block: the default


def test_heavy_compression_gets_one_row_per_entry(tmp_path):
    kw = dict(device="cpu", dtype="float32", load_format="dummy", max_num_seqs=2)
    auto = LLM(v4_config(tmp_path, 128), num_cache_blocks=6, **kw)
    fixed = LLM(v4_config(tmp_path, 128), block_size=16, num_cache_blocks=40, **kw)
    a, f = auto.engine.cache_plan, fixed.engine.cache_plan
    assert (a.block_size, f.block_size) == (128, 16)
    assert a.bytes_per_block / 128 < f.bytes_per_block / 16  # fewer bytes a token: no padded HCA rows
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(3, 300))}]
    assert auto.generate(prompt, sp)[0].outputs[0].token_ids == fixed.generate(prompt, sp)[0].outputs[0].token_ids
    assert LLM(v4_config(tmp_path, 8), num_cache_blocks=40, **kw).engine.cache_plan.block_size == 16
