"""Block-FP8 DeepSeek checkpoints under tensor parallelism (Gloo, CPU): the FP8 linears' weights and 128x128 tile
scales cut together (column-parallel heads and MLP rows, row-parallel output projections) and the routed experts'
width split over the tp ranks give one process's prompt and decode logits (1e-4 relative), greedy tokens and
expert loads at tp=2; a cut through a tile stops at build time naming the module."""
from __future__ import annotations

import pytest
import torch

from dayzero.distributed import ParallelState
from dayzero.models.registry import build_model, load_config
from dayzero.layers.fp8_linear import BlockFp8Linear
from dayzero.quant.fp8 import FP8
from dayzero.tools.quantize import quantize_checkpoint
from tests.distributed.test_tensor_parallel import compare_paths
from tests.hf.harness import make_hf_checkpoint

# every rank's piece whole 128-wide tiles at tp=2: q_b 4 heads x 128 rows, kv_b 4 x 128, o_proj 4 x 64 columns,
# the dense MLP 512 and the experts 256 wide
CONFIG = dict(
    vocab_size=300, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64,
    qk_rope_head_dim=64, v_head_dim=64, max_position_embeddings=256, initializer_range=0.06,
)


def fp8_checkpoint(tmp_path, **overrides):
    make_hf_checkpoint(tmp_path / "bf16", "deepseek_v3", seed=5, **{**CONFIG, **overrides})
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "deepseek_v3", fmt="fp8", progress=False)
    return tmp_path / "deepseek_v3"


def test_rank_holds_whole_tiles_of_each_fp8_linear(tmp_path):
    spec = load_config(fp8_checkpoint(tmp_path))
    model = build_model(spec, torch.float32, "meta", ParallelState(1, 2))
    attn, mlp, moe = model.model.layers[0].self_attn, model.model.layers[0].mlp, model.model.layers[1].mlp
    for lin, kind, shape in ((attn.q_b_proj, "column", (256, 128)), (attn.o_proj, "row", (256, 128)),
                             (mlp.gate_up_proj, "column", (512, 256)), (mlp.down_proj, "row", (256, 256)),
                             (moe.shared_experts.down_proj, "row", (256, 128))):
        assert isinstance(lin, BlockFp8Linear) and lin.kind == kind and lin.weight.dtype == FP8
        assert tuple(lin.weight.shape) == shape and tuple(lin.weight_scale_inv.shape) == (shape[0] // 128, shape[1] // 128)
        assert lin.shards["weight"] is lin.shards["weight_scale_inv"]
    assert not hasattr(attn.q_a_proj, "shards")  # the latent down-projections stay whole on every rank
    assert moe.expert_tp and tuple(moe.w1_scale_inv.shape) == (4, 2, 2) and tuple(moe.w2_scale_inv.shape) == (4, 2, 1)


def test_fp8_deepseek_at_tp2_matches_one_process(tmp_path):
    compare_paths(tmp_path, [fp8_checkpoint(tmp_path)], tp=2)


def test_a_cut_through_a_tile_names_the_module(tmp_path):
    spec = load_config(fp8_checkpoint(tmp_path, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64))
    build_model(spec, torch.float32, "meta", ParallelState(0, 1))  # whole tiles at tp=1 (edge tiles padded)
    with pytest.raises(ValueError, match=r"tp=2 leaves .*q_b_proj 96 output features per rank"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 2))
    spec = load_config(fp8_checkpoint(tmp_path / "experts", moe_intermediate_size=128))
    with pytest.raises(ValueError, match="tp=2 splits block-FP8 experts into 64-wide slices"):
        build_model(spec, torch.float32, "meta", ParallelState(0, 2))
