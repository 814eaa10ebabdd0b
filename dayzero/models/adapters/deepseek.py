"""DeepSeek-V3 (MLA + sigmoid/group-limited MoE with shared experts) and its DSA successors
(DeepSeek-V3.2 and GLM-MoE-DSA: the same blocks plus the lightning indexer).

Kimi-K2.5's text model is DeepSeek-V3 (``text_config`` of type ``kimi_k2`` or ``deepseek_v3``) with plain RoPE
over text positions. Its checkpoints keep the original layout, ``language_model.model.*`` and
``language_model.lm_head``; transformers 5 writes the decoder layers as ``blocks`` there (its rename of the
vision tower's blocks to layers, reversed on save, catches them too)."""
from __future__ import annotations

from dayzero.config.spec import IndexerSpec, LayerSpec, MLASpec, ModelSpec, MoESpec, softmax_scale
from dayzero.models.adapters.common import (
    attn_rules, base_rules, dense_mlp_spec, dtype_of, eos_of, get, moe_layer_rules, nested, rope_spec, text_config,
    weight_format,
)
from dayzero.models.registry import Adapter, register


def moe_spec(raw: dict) -> MoESpec:
    n_shared = raw.get("n_shared_experts") or 0
    return MoESpec(
        get(raw, "n_routed_experts", "num_local_experts"), raw["num_experts_per_tok"], raw["moe_intermediate_size"],
        router="sigmoid", correction_bias=True, n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1,
        norm_topk_prob=raw.get("norm_topk_prob", True), routed_scaling_factor=raw.get("routed_scaling_factor", 1.0),
        n_shared=n_shared, shared_intermediate_size=n_shared * raw["moe_intermediate_size"],
        expert_format=weight_format(raw)[0],
    )


def is_moe_layer(raw: dict, i: int) -> bool:
    return i >= raw.get("first_k_dense_replace", 0) and i % raw.get("moe_layer_freq", 1) == 0


def indexer_spec(raw: dict, interleaved: bool = False, shared: bool = False) -> IndexerSpec:
    """The lightning indexer; its RoPE covers the first ``qk_rope_head_dim`` dims with MLA's frequencies."""
    rope_dim = raw["qk_rope_head_dim"]
    return IndexerSpec(raw["index_n_heads"], raw["index_head_dim"], raw["index_topk"],
                       rope_spec(raw, rope_dim, interleaved=interleaved, dim=rope_dim), shared=shared)


# DeepSeek's reference code and transformers build the q/kv latent RMSNorms with their default eps 1e-6,
# whatever rms_norm_eps says (GLM-5 sets 1e-5 there)
LATENT_NORM_EPS = 1e-6


def mla_spec(raw: dict, indexer: IndexerSpec | None = None) -> MLASpec:
    nope, rope_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
    rope = rope_spec(raw, rope_dim, interleaved=raw.get("rope_interleave", True), dim=rope_dim)
    return MLASpec(
        raw["num_attention_heads"], raw.get("q_lora_rank"), raw["kv_lora_rank"], nope, rope_dim, raw["v_head_dim"],
        rope=rope, scale=softmax_scale(nope + rope_dim, rope.scaling), bias=raw.get("attention_bias", False),
        indexer=indexer, latent_norm_eps=LATENT_NORM_EPS,
    )


def model_spec(raw: dict, layers) -> ModelSpec:
    return ModelSpec(
        raw["model_type"], raw["vocab_size"], raw["hidden_size"], tuple(layers), raw["max_position_embeddings"],
        raw.get("rms_norm_eps", 1e-6), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw), bos_token_id=raw.get("bos_token_id"),
        linear_format=weight_format(raw)[0], linear_exclude=weight_format(raw)[1],
    )


def deepseek_spec(raw: dict, indexed: bool = False) -> ModelSpec:
    attn = mla_spec(raw, indexer_spec(raw) if indexed else None)
    return model_spec(raw, (
        LayerSpec(i, attn, moe_spec(raw) if is_moe_layer(raw, i) else dense_mlp_spec(raw))
        for i in range(raw["num_hidden_layers"])
    ))


def deepseek_rules(spec: ModelSpec):
    return base_rules() + moe_layer_rules() + attn_rules()


register(Adapter(
    "deepseek_v3", deepseek_spec, deepseek_rules,
    # multi-token-prediction layers past num_hidden_layers are for speculative decoding, not loaded yet
    notes="MLA + sigmoid group-limited MoE + shared experts",
))


KIMI_K25_TEXT = {r"model\.layers\.": r"language_model\.model\.(?:layers|blocks)\.",
                 r"model\.": r"language_model\.model\.", r"lm_head\.": r"language_model\.lm_head\."}


def kimi_k25_spec(raw: dict) -> ModelSpec:
    kind = (raw.get("text_config") or {}).get("model_type", "deepseek_v3")
    if kind not in ("deepseek_v3", "kimi_k2"):
        raise ValueError(f"kimi_k25 text_config of model_type {kind!r} is not supported; "
                         "supported: deepseek_v3, kimi_k2")
    return deepseek_spec(text_config(raw))


register(Adapter(
    "kimi_k25", kimi_k25_spec, lambda spec: nested(deepseek_rules(spec), KIMI_K25_TEXT),
    # the vision tower and its projector, loaded by the multimodal package
    ignore=(r"vision_tower\..*", r"(?:model\.)?mm_projector\..*"),
    notes="DeepSeek-V3 text model of a vision-language checkpoint",
))
