"""kimi_linear, qwen3_next: transformers' tiny random linear-attention hybrids load and match in fp32.

A prompt of 70 tokens crosses the 64-token chunk of the delta-rule ops (and, at 64 tokens per engine
step, carries its state across prefill chunks); the batch mixes lengths, so decode runs several state slots.
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.hf.harness import check_parity, make_hf_checkpoint, prompt_batch

COMMON = dict(vocab_size=300, hidden_size=64, num_attention_heads=4, initializer_range=0.08, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
LENGTHS = (5, 70, 12, 40)

FAMILIES = {
    "kimi_linear": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        intermediate_size=96, moe_intermediate_size=24, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, linear_num_heads=2, linear_head_dim=16,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.446, rms_norm_eps=1e-5,
    ),
    "qwen3_next": dict(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        intermediate_size=96, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}


def slow_decay(model):
    """Gated DeltaNet's fresh init (dt_bias = 1, A up to 16) forgets within a few tokens, so a state carried
    wrongly across steps or slots would barely show. Per-token decays of about e^-0.01, as slow as Kimi-Linear's
    init already is, make each token's state matter for the next hundred."""
    for layer in model.model.layers:
        gdn = getattr(layer, "linear_attn", None)
        if gdn is not None:
            gdn.A_log.copy_(torch.empty_like(gdn.A_log).uniform_(0.01, 1.0).log())
            gdn.dt_bias.fill_(math.log(math.expm1(0.02)))  # softplus(dt_bias) = 0.02


INIT = {"qwen3_next": slow_decay}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parity_with_transformers(tmp_path, model_type):
    hf = make_hf_checkpoint(tmp_path, model_type, init=INIT.get(model_type), **COMMON, **FAMILIES[model_type])
    check_parity(tmp_path, hf, prompt_batch(COMMON["vocab_size"], lengths=LENGTHS))
