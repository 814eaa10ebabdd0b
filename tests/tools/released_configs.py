"""Released config.json values of full-size models and their published parameter counts.

``published``: (total, active per token) in parameters; ``active`` says which convention the publisher
used (``all``: embedding and LM head included; ``no_input_embedding``: LM head only; ``excl_embeddings``:
neither). ``tol`` is the
relative tolerance: tight where the publisher gives three digits, looser for round "48B / 3B" names.
Multi-token-prediction layers are not part of the main model and not counted by either side.
"""
from __future__ import annotations

_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}

_GPT_OSS = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "eos_token_id": 200002, "pad_token_id": 199999,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}


def _gpt_oss(layers: int, experts: int) -> dict:
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return {**_GPT_OSS, "num_hidden_layers": layers, "num_local_experts": experts, "layer_types": types}


def _qwen3_moe(hidden, inter, moe_inter, layers, heads, kv, experts) -> dict:
    return {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": hidden, "intermediate_size": inter,
        "moe_intermediate_size": moe_inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": 128, "num_experts": experts, "num_experts_per_tok": 8,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "max_position_embeddings": 40960,
        "max_window_layers": layers, "use_sliding_window": False, "sliding_window": None, "rope_theta": 1000000.0,
        "rope_scaling": None, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "attention_bias": False,
    }


def _glm45(hidden, inter, moe_inter, layers, experts, dense, qk_norm, scale) -> dict:
    return {
        "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": hidden, "intermediate_size": inter,
        "moe_intermediate_size": moe_inter, "num_hidden_layers": layers, "num_nextn_predict_layers": 1,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": dense, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "routed_scaling_factor": scale, "partial_rotary_factor": 0.5, "use_qk_norm": qk_norm,
        "attention_bias": True, "max_position_embeddings": 131072, "rope_theta": 1000000, "rope_scaling": None,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }


RELEASED = {
    "DeepSeek-V3": (_DEEPSEEK_V3, (671e9, 37e9), "all", 0.03),
    "DeepSeek-V3.2-Exp": ({**_DEEPSEEK_V3, "model_type": "deepseek_v32", "index_n_heads": 64, "index_head_dim": 128,
                           "index_topk": 2048}, (671e9, 37e9), "all", 0.05),
    "Mixtral-8x7B": ({
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 32768, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }, (46.7e9, 12.9e9), "all", 0.03),
    "Qwen3-30B-A3B": (_qwen3_moe(2048, 6144, 768, 48, 32, 4, 128), (30.5e9, 3.3e9), "all", 0.03),
    "Qwen3-235B-A22B": (_qwen3_moe(4096, 12288, 1536, 94, 64, 4, 128), (235e9, 22e9), "all", 0.03),
    "gpt-oss-120b": (_gpt_oss(36, 128), (116.83e9, 5.13e9), "no_input_embedding", 0.03),
    "gpt-oss-20b": (_gpt_oss(24, 32), (20.91e9, 3.61e9), "no_input_embedding", 0.03),
    "GLM-4.5": (_glm45(5120, 12288, 1536, 92, 160, 3, True, 2.5), (355e9, 32e9), "excl_embeddings", 0.03),
    "GLM-4.5-Air": (_glm45(4096, 10944, 1408, 46, 128, 1, False, 1.0), (106e9, 12e9), "excl_embeddings", 0.03),
    "Qwen3-Next-80B-A3B": ({
        "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_hidden_layers": 48,
        "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25,
        "rope_theta": 10000000, "rope_scaling": None, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu",
    }, (80e9, 3e9), "excl_embeddings", 0.10),
    "Kimi-Linear-48B-A3B": ({
        "model_type": "kimi_linear", "vocab_size": 163840, "hidden_size": 2304, "intermediate_size": 9216,
        "moe_intermediate_size": 1024, "num_hidden_layers": 27, "num_attention_heads": 32, "num_key_value_heads": 32,
        "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True, "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "routed_scaling_factor": 2.446,
        "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                               "kda_layers": [i for i in range(1, 27) if i % 4], "head_dim": 128, "num_heads": 32,
                               "short_conv_kernel_size": 4},
        "model_max_length": 1048576, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }, (48e9, 3e9), "no_input_embedding", 0.10),
}
