"""Expert parallelism on the CPU with Gloo: spawned ranks against one process on the same weights.

Each rank holds ``n_experts / ep`` routed experts, routes its share of the step's tokens and exchanges rows with
the other ranks by all-to-all. Whole models made by transformers give prompt and decode logits within 1e-4
relative of one process, the same greedy tokens and the same per-expert load counters on every rank:

- ep=2 alone (attention replicated): qwen3_moe (per-expert checkpoint tensors), deepseek_v3 (grouped routing with
  a correction bias, shared experts, MLA), kimi_linear (KDA);
- tp=2 with ep=2 on the same two ranks: qwen3_moe, glm4_moe;
- ep=4 over two tp=2 replicas: qwen3_moe;
- ep=2 inside a stage of four ranks (tp=4): two expert groups, each expert's width split over two ranks, qwen3_moe
  and MXFP4 gpt-oss;
- gpt-oss with MXFP4 experts (stacked packed tensors, expert biases) at ep=2, and split by tp=2 (expert TP),
  converted per layer in the workspace as on one process;
- with redundant copies of experts, rebalanced from the observed loads every two steps, outputs do not change.
"""
from __future__ import annotations

import pytest
import torch

from dayzero.distributed import ParallelState
from dayzero.layers.expert_placement import balanced_placement, initial_placement, replica_table
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


def test_ep2_inside_a_stage_of_four_splits_each_expert_over_two(tmp_path):
    """1 < ep < G: tp=4 with ep=2 is two expert groups of two ranks (ranks 0, 2 and 1, 3), each expert's width split
    over the two ranks of an expert-TP group (0, 1 and 2, 3)."""
    compare_with_one_process(tmp_path, ("qwen3_moe",), tp=4, ep=2)


def test_mxfp4_experts_in_expert_groups_split_by_width_match_one_process(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **{**GPT_OSS, "intermediate_size": 64})
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    compare_paths(tmp_path, [tmp_path / "gpt_oss"], tp=4, ep=2)


def test_a_rank_of_an_expert_group_holds_its_experts_slice(tmp_path):
    """The loader cuts each checkpoint tensor twice: the rank's expert slots, then its slice of each expert's width
    (per-expert tensors: only the slice)."""
    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    spec = load_config(path)
    state = ParallelState(1, 4, ep_rank=1, ep_size=2, world_rank=3, world_size=4, ep_tp_rank=1, ep_tp_size=2)
    model = build_model(spec, torch.float32, "meta", state)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    I = spec.layers[-1].mlp.intermediate_size
    assert moe.expert_tp and tuple(moe.w1.shape[:2]) == (4, I) and moe.w2.shape[-1] == I // 2
    assert moe.shards["w1"].inner.dim == 1 and moe.shards["w2"].inner.dim == 2
    raw, cfg_file = read_config(path)
    adapter = adapter_for(raw, cfg_file)
    assert check_headers(model, path, adapter.rules(spec), adapter.ignore) == []


def test_mxfp4_experts_at_ep2_match_one_process(tmp_path):
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **GPT_OSS)
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    compare_paths(tmp_path, [tmp_path / "gpt_oss"], tp=1, ep=2)


def test_mxfp4_experts_split_by_tp_match_one_process(tmp_path):
    """Expert TP (tp=2 without ep): each rank holds half of every expert's packed blocks and scales."""
    make_hf_checkpoint(tmp_path / "bf16", "gpt_oss", seed=3, **{**GPT_OSS, "intermediate_size": 64})
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "gpt_oss", progress=False)
    compare_paths(tmp_path, [tmp_path / "gpt_oss"], tp=2)
    spec = load_config(tmp_path / "gpt_oss")
    with pytest.raises(ValueError, match="tp=4 splits MXFP4 experts into 16-wide slices"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 4))


def test_rank_holds_its_experts_and_bad_ep_names_the_setting(tmp_path):
    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    spec = load_config(path)
    with pytest.raises(ValueError, match="ep=3 does not divide n_experts=8"):
        build_model(spec, torch.float32, "meta", ParallelState(ep_rank=0, ep_size=3))
    model = build_model(spec, torch.float32, "meta", ParallelState(ep_rank=1, ep_size=4, world_rank=1, world_size=4))
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    assert moe.w1.shape[0] == 2 and moe.gate.weight.shape[0] == 8 and moe.slot_expert[2:4] == [2, 3]
    assert "e_score_correction_bias" not in moe.shards and moe.shards["w1"].experts
    raw, cfg_file = read_config(path)
    adapter = adapter_for(raw, cfg_file)
    assert check_headers(model, path, adapter.rules(spec), adapter.ignore) == []  # other ranks' experts skipped


# --- balancing ------------------------------------------------------------------------------------------
def test_balanced_placement_spreads_the_hot_experts():
    load = [100, 1, 1, 1, 50, 1, 1, 1]  # experts 0 and 4 are hot
    slots = balanced_placement(load, ep=2, slots=6)  # 4 redundant slots
    assert len(slots) == 12
    copies = {e: slots.count(e) for e in range(8)}
    assert copies[0] >= 2 and copies[4] >= 2 and all(c >= 1 for c in copies.values()) and sum(copies.values()) == 12
    rank_load = [sum(load[e] / copies[e] for e in slots[r * 6:(r + 1) * 6]) for r in range(2)]
    assert max(rank_load) / min(rank_load) < 1.2  # the checkpoint's order puts 150 of 157 on rank 0
    assert all(len(set(slots[r * 6:(r + 1) * 6])) == 6 for r in range(2))  # no rank holds two copies of one
    table, n = replica_table(slots, 8)
    assert n.tolist() == [copies[e] for e in range(8)] and all(slots[p] == e for e in range(8) for p in table[e].tolist())
    assert initial_placement(8, 2, 6) == [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 0, 1]
    with pytest.raises(ValueError, match="no copy of experts"):
        replica_table([0, 1, 1, 3], 4)


def rebalance_rank(state: ParallelState, path: str, out_dir: str) -> None:
    """Greedy tokens and logits of one prompt set with redundant experts, rebalanced every 2 steps."""
    from tests.distributed.test_tensor_parallel import ENGINE, greedy_tokens, run_chunks
    from dayzero.engine.engine import EngineConfig, LLMEngine
    from tests.hf.harness import prompt_batch

    engine = LLMEngine(EngineConfig(model=path, **ENGINE, num_redundant_experts=4, eplb_interval=2), state)
    moe = engine.moe_layers
    assert all(m.w1.shape[0] == 6 for m in moe)  # 4 experts of the checkpoint + 2 copies per rank
    before = [list(m.slot_expert) for m in moe]
    prompts = prompt_batch(engine.model_config.vocab_size, lengths=(5, 23, 12))
    logits = [run_chunks(engine, ids, [len(ids)]) for ids in prompts]
    tokens = greedy_tokens(engine, prompts)
    moved = [m.slot_expert != b for m, b in zip(moe, before)]
    assert any(moved), "the observed loads never moved an expert"
    logits += [run_chunks(engine, prompts[1], [20, 1, 1, 1])]  # after the moves
    torch.save({"logits": logits, "tokens": tokens}, f"{out_dir}/rank{state.world_rank}.pt")


def test_rebalancing_mid_run_leaves_outputs_unchanged(tmp_path):
    from tests.distributed.test_tensor_parallel import run_model, spawn
    from dayzero.engine.engine import EngineConfig, LLMEngine

    path = tmp_path / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    spawn(rebalance_rank, str(path), str(tmp_path), tp=1, ep=2)
    want = run_model(path)
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["tokens"] == want["tokens"]
        for a, b in zip(got["logits"], want["prompt"] + [want["decode"]]):
            assert ((a - b).norm() / b.norm()).item() <= 1e-4
    with pytest.raises(ValueError, match="num_redundant_experts=4 needs expert parallelism"):
        LLMEngine(EngineConfig(model=str(path), device="cpu", num_redundant_experts=4))
    with pytest.raises(ValueError, match="eplb_interval must be an int >= 0"):
        EngineConfig(eplb_interval=-1)
