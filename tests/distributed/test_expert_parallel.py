"""Expert parallelism on the CPU with Gloo: spawned ranks against one process on the same weights.

Each rank holds ``n_experts / ep`` routed experts, routes its share of the step's tokens and exchanges rows with
the other ranks by all-to-all. Whole models made by transformers give prompt and decode logits within 1e-4
relative of one process, the same greedy tokens and the same per-expert load counters on every rank:

- ep=2 alone (attention replicated): qwen3_moe (per-expert checkpoint tensors), deepseek_v3 (grouped routing with
  a correction bias, shared experts, MLA), kimi_linear (KDA);
- tp=2 with ep=2 on the same two ranks: qwen3_moe, glm4_moe;
- ep=4 over two tp=2 replicas: qwen3_moe;
- gpt-oss with MXFP4 experts (stacked packed tensors, expert biases) at ep=2, converted per layer in the
  workspace as on one process.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.distributed import ParallelState
from dayzero.layers.moe import MoE
from dayzero.loader.safetensors_loader import check_headers
from dayzero.models.registry import adapter_for, build_model, load_config, read_config
from dayzero.tools.quantize import quantize_checkpoint
from tests.distributed.test_tensor_parallel import CONFIGS, compare_paths, compare_with_one_process
from tests.hf.harness import make_hf_checkpoint
from tests.hf.test_gpt_oss_mxfp4 import CONFIG as GPT_OSS


def test_experts_spread_over_two_ranks(tmp_path):
    compare_with_one_process(tmp_path, ("qwen3_moe", "deepseek_v3", "kimi_linear"), tp=1, ep=2)


def test_tp2_with_ep2_matches_one_process(tmp_path):
    compare_with_one_process(tmp_path, ("qwen3_moe", "glm4_moe"), tp=2, ep=2)


def test_ep4_over_two_tp_replicas_matches_one_process(tmp_path):
    compare_with_one_process(tmp_path, ("qwen3_moe",), tp=2, ep=4)


def test_mxfp4_experts_at_ep2_match_one_process(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **GPT_OSS)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    compare_paths(tmp_path, [tmp_path / "gpt_oss"], tp=1, ep=2)


def test_rank_holds_its_experts_and_bad_ep_names_the_setting(tmp_path):
    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    spec = load_config(path)
    with pytest.raises(ValueError, match="ep=3 does not divide n_experts=8"):
        build_model(spec, torch.float32, "meta", ParallelState(ep_rank=0, ep_size=3))
    model = build_model(spec, torch.float32, "meta", ParallelState(ep_rank=1, ep_size=4, world_rank=1, world_size=4))
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.w1.shape[0] == 2 and moe.gate.weight.shape[0] == 8 and moe.expert_start == 2
    assert "e_score_correction_bias" not in moe.shards and moe.shards["w1"].experts
    raw, cfg_file = read_config(path)
    adapter = adapter_for(raw, cfg_file)
    assert check_headers(model, path, adapter.rules(spec), adapter.ignore) == []  # other ranks' experts skipped
