"""Qwen3-Next: Gated DeltaNet linear attention (3 of 4 layers) + gated full attention + softmax top-k MoE
with a sigmoid-gated shared expert (ARCHITECTURE.md 2.3, 3.2).

Every decoder RMSNorm (layer norms, final norm, attention q/k norms) is zero-centred, applied as (1 + w);
the Gated DeltaNet output norm is not (plain weight, SiLU(z) gate). Full-attention q_proj emits
``[q | gate]`` per head; RoPE is NeoX on the first ``partial_rotary_factor`` of each head. Checkpoints
name the mixer ``linear_attn`` in linear layers and the shared expert ``shared_expert`` (singular).

Qwen3.5-MoE's text model is the same network with every layer MoE and top-k weights always renormalised; its
Gated DeltaNet stores q, k, v, z, b and a as separate projections already in our head-major order
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``). Its multimodal RoPE (``mrope_section``) is
plain RoPE for text, whose three position axes are equal.
"""
from __future__ import annotations

from dayzero.config.spec import GQASpec, LayerSpec, MLPSpec, ModelSpec, MoESpec
from dayzero.config.spec import GDNSpec
from dayzero.layers.attention.gdn import ungroup_ba, ungroup_qkvz
from dayzero.loader.rules import Rule, rows
from dayzero.models.adapters.common import (
    LANGUAGE_MODEL, L, attn_rules, base_rules, dense_mlp_spec, dtype_of, eos_of, get, moe_layer_rules, nested,
    rope_spec, text_config,
)
from dayzero.models.registry import Adapter, register


def _layer_types(raw: dict) -> list[str]:
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    every = raw.get("full_attention_interval", 4)
    return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(raw["num_hidden_layers"])]


def _gdn(raw: dict) -> GDNSpec:
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported for the Gated DeltaNet conv; supported: silu")
    return GDNSpec(raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"],
                   raw["linear_value_head_dim"], raw.get("linear_conv_kernel_dim", 4))


def _gqa(raw: dict) -> GQASpec:
    hd = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    p = {"partial_rotary_factor": 0.25, **raw}  # transformers' default when the config names none
    return GQASpec(raw["num_attention_heads"], raw["num_key_value_heads"], hd, rope_spec(p, hd),
                   qkv_bias=raw.get("attention_bias", False), qk_norm="rms", output_gate="q_interleaved")


def _mlp(raw: dict, i: int) -> MLPSpec | MoESpec:
    n_experts = get(raw, "num_experts", "num_local_experts", default=0)
    if i in set(raw.get("mlp_only_layers") or []) or not n_experts or (i + 1) % raw.get("decoder_sparse_step", 1):
        return dense_mlp_spec(raw)
    shared = raw.get("shared_expert_intermediate_size") or 0
    return MoESpec(n_experts, raw["num_experts_per_tok"], raw["moe_intermediate_size"], router="softmax",
                   correction_bias=False, norm_topk_prob=raw.get("norm_topk_prob", True), n_shared=int(shared > 0),
                   shared_intermediate_size=shared, shared_gate=shared > 0)


def qwen3_next_spec(raw: dict) -> ModelSpec:
    gdn, gqa = _gdn(raw), _gqa(raw)
    layers = tuple(LayerSpec(i, gqa if t == "full_attention" else gdn, _mlp(raw, i))
                   for i, t in enumerate(_layer_types(raw)))
    return ModelSpec(
        raw["model_type"], raw["vocab_size"], raw["hidden_size"], layers, raw["max_position_embeddings"],
        raw.get("rms_norm_eps", 1e-6), norm_offset=True, tie_word_embeddings=raw.get("tie_word_embeddings", False),
        torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw), bos_token_id=raw.get("bos_token_id"),
    )


def qwen3_5_moe_spec(raw: dict) -> ModelSpec:
    # every layer MoE, top-k weights renormalised: transformers' config has no setting for either
    return qwen3_next_spec({**text_config(raw), "norm_topk_prob": True, "mlp_only_layers": [],
                            "decoder_sparse_step": 1})


def _gdn_of(spec: ModelSpec) -> GDNSpec | None:
    return next((l.attn for l in spec.layers if isinstance(l.attn, GDNSpec)), None)


def _rules(linear: list[Rule]) -> list[Rule]:
    """The name table around the Gated DeltaNet input projections' rules ``linear`` (ahead of the mixer's catch-all)."""
    return base_rules() + linear + attn_rules("linear_attn") + attn_rules() + moe_layer_rules(shared="shared_expert") + [
        Rule(rf"{L}\.mlp\.shared_expert_gate\.weight", "model.layers.{0}.mlp.shared_expert_gate.weight"),
    ]


def qwen3_next_rules(spec: ModelSpec) -> list[Rule]:
    gdn, dst = _gdn_of(spec), "model.layers.{0}.self_attn"
    return _rules([] if gdn is None else [
        Rule(rf"{L}\.linear_attn\.in_proj_qkvz\.weight", f"{dst}.in_proj_qkvz.weight", transform=ungroup_qkvz(gdn)),
        Rule(rf"{L}\.linear_attn\.in_proj_ba\.weight", f"{dst}.in_proj_ba.weight", transform=ungroup_ba(gdn)),
    ])


def qwen3_5_moe_rules(spec: ModelSpec) -> list[Rule]:
    gdn, dst = _gdn_of(spec), "model.layers.{0}.self_attn"
    C = gdn.conv_dim if gdn else 0  # our in_proj_qkvz: [q | k | v] (the conv's C channels), then z
    return nested(_rules([] if gdn is None else [
        Rule(rf"{L}\.linear_attn\.in_proj_qkv\.weight", f"{dst}.in_proj_qkvz.weight", lambda p, m: p.narrow(0, 0, C)),
        Rule(rf"{L}\.linear_attn\.in_proj_z\.weight", f"{dst}.in_proj_qkvz.weight",
             lambda p, m: p.narrow(0, C, p.shape[0] - C)),
        Rule(rf"{L}\.linear_attn\.in_proj_b\.weight", f"{dst}.in_proj_ba.weight", rows(0, 2)),
        Rule(rf"{L}\.linear_attn\.in_proj_a\.weight", f"{dst}.in_proj_ba.weight", rows(1, 2)),
    ]), LANGUAGE_MODEL)


register(Adapter(
    "qwen3_next", qwen3_next_spec, qwen3_next_rules,
    ignore=(r"mtp\..*",),  # multi-token-prediction head, for speculative decoding; not loaded yet
    notes="Gated DeltaNet + gated GQA + softmax MoE with a gated shared expert",
))
register(Adapter(
    "qwen3_5_moe", qwen3_5_moe_spec, qwen3_5_moe_rules,
    # the vision tower (the engine loads it into the tower: dayzero.multimodal.families; tools that build the
    # text model alone skip it) and the multi-token-prediction head
    ignore=(r"model\.visual\..*", r"mtp\..*"),
    notes="Qwen3-Next-style text model (multimodal RoPE) of a vision-language checkpoint",
))
