"""Qwen3-MoE and Mixtral: GQA (Qwen3 with per-head q/k RMSNorm) + softmax top-k MoE; GLM-4-MoE:
GQA with partial RoPE + DeepSeek-style sigmoid routing with shared experts.

Qwen3-VL-MoE's text model is Qwen3-MoE with top-k weights always renormalised and multimodal RoPE: its
``mrope_section`` gives each frequency to a temporal, height or width position, and a text token has all
three equal to its position, so for text it is plain RoPE. Its fused experts are stored [E, out, in]
(transformers 5) or [E, in, out] (the released files)."""
from __future__ import annotations

from dayzero.config.spec import GQASpec, LayerSpec, ModelSpec, MoESpec
from dayzero.loader.rules import Rule, as_out_in, same
from dayzero.models.adapters.common import (
    LANGUAGE_MODEL, L, attn_rules, base_rules, dense_mlp_spec, dtype_of, eos_of, expert_rules, get, moe_layer_rules,
    nested, rope_spec, text_config,
)
from dayzero.models.registry import Adapter, register


def _gqa(raw: dict, qk_norm: bool, window: int | None = None) -> GQASpec:
    hd = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return GQASpec(
        raw["num_attention_heads"], raw["num_key_value_heads"], hd, rope_spec(raw, hd),
        qkv_bias=raw.get("attention_bias", False), qk_norm="rms" if qk_norm else None, sliding_window=window,
    )


def _model(raw: dict, layers) -> ModelSpec:
    return ModelSpec(
        raw["model_type"], raw["vocab_size"], raw["hidden_size"], tuple(layers), raw["max_position_embeddings"],
        raw.get("rms_norm_eps", 1e-6), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw), bos_token_id=raw.get("bos_token_id"),
    )


def qwen3_moe_spec(raw: dict) -> ModelSpec:
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
    n_experts = get(raw, "num_experts", "num_local_experts", default=0)
    moe = MoESpec(n_experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"], router="softmax",
                  correction_bias=False, norm_topk_prob=raw.get("norm_topk_prob", False))
    layers = []
    for i in range(raw["num_hidden_layers"]):
        window = raw.get("sliding_window") if raw.get("use_sliding_window") and i >= raw.get("max_window_layers", 0) else None
        is_moe = i not in dense and n_experts > 0 and (i + 1) % step == 0
        layers.append(LayerSpec(i, _gqa(raw, True, window), moe if is_moe else dense_mlp_spec(raw)))
    return _model(raw, layers)


def mixtral_spec(raw: dict) -> ModelSpec:
    moe = MoESpec(raw["num_local_experts"], raw["num_experts_per_tok"], raw["intermediate_size"], router="softmax",
                  correction_bias=False, norm_topk_prob=True)
    attn = _gqa(raw, False, raw.get("sliding_window"))
    return _model(raw, [LayerSpec(i, attn, moe) for i in range(raw["num_hidden_layers"])])


def glm4_moe_spec(raw: dict) -> ModelSpec:
    n_shared = raw.get("n_shared_experts") or 0
    moe = MoESpec(
        raw["n_routed_experts"], raw["num_experts_per_tok"], raw["moe_intermediate_size"], router="sigmoid",
        n_group=raw.get("n_group") or 1, topk_group=raw.get("topk_group") or 1, norm_topk_prob=raw.get("norm_topk_prob", True),
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0), n_shared=n_shared,
        shared_intermediate_size=n_shared * raw["moe_intermediate_size"],
    )
    attn = _gqa(raw, raw.get("use_qk_norm", False))
    first_dense = raw.get("first_k_dense_replace", 0)
    return _model(raw, [LayerSpec(i, attn, moe if i >= first_dense else dense_mlp_spec(raw))
                        for i in range(raw["num_hidden_layers"])])


def _gqa_moe_rules(spec: ModelSpec):
    return base_rules() + attn_rules() + moe_layer_rules()


def qwen3_vl_moe_spec(raw: dict) -> ModelSpec:
    # transformers' default theta for this family; its router renormalises whatever norm_topk_prob says
    return qwen3_moe_spec({"rope_theta": 500000.0, **text_config(raw), "norm_topk_prob": True})


def _qwen3_vl_moe_rules(spec: ModelSpec):
    moe = next((l.mlp for l in spec.layers if isinstance(l.mlp, MoESpec)), None)
    D, I = spec.hidden_size, moe.intermediate_size if moe else 0

    def stacked(out: int, inp: int):  # a square stack cannot be told apart: read as transformers writes it
        return same if out == inp else as_out_in(out, inp)

    experts = [
        Rule(rf"{L}\.mlp\.experts\.gate_up_proj", "model.layers.{0}.mlp.w1", transform=stacked(2 * I, D)),
        Rule(rf"{L}\.mlp\.experts\.down_proj", "model.layers.{0}.mlp.w2", transform=stacked(D, I)),
    ]
    return nested(experts + _gqa_moe_rules(spec), LANGUAGE_MODEL)


def _mixtral_rules(spec: ModelSpec):
    return base_rules() + attn_rules() + expert_rules("block_sparse_moe", gate="w1", up="w3", down="w2")


register(Adapter("qwen3_moe", qwen3_moe_spec, _gqa_moe_rules, notes="GQA + q/k norm + softmax top-k MoE"))
register(Adapter("mixtral", mixtral_spec, _mixtral_rules, notes="GQA + softmax top-k MoE"))
register(Adapter("qwen3_vl_moe", qwen3_vl_moe_spec, _qwen3_vl_moe_rules,
                 # the vision tower: the engine loads it (dayzero.multimodal.families), text-only tools skip it
                 ignore=(r"model\.visual\..*",),
                 notes="Qwen3-MoE text model (multimodal RoPE) of a vision-language checkpoint"))
register(Adapter("glm4_moe", glm4_moe_spec, _gqa_moe_rules, notes="GQA + partial RoPE + sigmoid MoE + shared experts"))
