"""A tiny config for every registered Hugging Face model type, made from transformers' own defaults for
that type with the sizes shrunk: each key below is overridden only where the type's config has it, layer
lists are cut to the first layers that still hold every kind, and equalities the defaults hold (kv heads
equal to heads) are kept. A vision-language config's ``text_config`` is shrunk the same way."""
from __future__ import annotations

import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

SMALL = dict(
    hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=300, n_routed_experts=8, num_experts=8, num_local_experts=8, num_experts_per_tok=2,
    num_experts_per_token=2, experts_per_token=2, n_group=2, num_expert_group=2, topk_group=1, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, index_n_heads=4, index_head_dim=16,
    index_topk=8, linear_num_heads=2, linear_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, shared_expert_intermediate_size=24,
    moe_shared_expert_intermediate_size=24, first_k_dense_replace=1, max_position_embeddings=256, moe_latent_size=32,
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, sliding_window=8,
)
LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types", "layers_block_type")


def tiny_hf_config(model_type: str) -> dict:
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_dict()
    if isinstance(d.get("text_config"), dict):
        d["text_config"] = _shrink(d["text_config"])
    return _shrink(d)


def _shrink(d: dict) -> dict:
    kv_equal = d.get("num_key_value_heads") == d.get("num_attention_heads")
    for k, v in SMALL.items():
        if d.get(k) is not None:
            d[k] = v
    if kv_equal and "num_key_value_heads" in d:
        d["num_key_value_heads"] = d["num_attention_heads"]
    lists = [d[k] for k in LAYER_LISTS if isinstance(d.get(k), list)]
    n = 4
    for lst in lists:
        n = max(n, 1 + max(lst.index(v) for v in set(map(str, lst)) if v in lst))
    if "num_hidden_layers" in d:
        d["num_hidden_layers"] = n = min(n, d["num_hidden_layers"])
    for k in LAYER_LISTS:
        if isinstance(d.get(k), list):
            d[k] = d[k][:n]
    if isinstance(d.get("mlp_only_layers"), list):
        d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < n]
    return d


def tiny_config(model_type: str) -> dict:
    if model_type == "dayzero_hybrid":
        return json.loads((CONFIGS / "dayzero-tiny.json").read_text())
    return tiny_hf_config(model_type)
