"""deepseek_v3, qwen3_moe, mixtral, glm4_moe: transformers' tiny random models load and match in fp32."""
from __future__ import annotations

import pytest

from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}
COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, max_position_embeddings=256, initializer_range=0.08)

FAMILIES = {
    "deepseek_v3": dict(
        intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
        rope_parameters=YARN,
    ),
    "qwen3_moe": dict(
        intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True,
    ),
    "mixtral": dict(intermediate_size=40, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_local_experts=6,
                    num_experts_per_tok=2),
    "glm4_moe": dict(
        intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
        partial_rotary_factor=0.5, use_qk_norm=True, routed_scaling_factor=1.8,
    ),
}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parity_with_transformers(tmp_path, model_type):
    hf = make_hf_checkpoint(tmp_path, model_type, **COMMON, **FAMILIES[model_type])
    check_parity(tmp_path, hf, prompt_batch(COMMON["vocab_size"]))
