"""Kimi-Linear: KDA linear attention (about 3 of 4 layers) + NoPE MLA + DeepSeek-style sigmoid MoE with a
shared expert, the first layer(s) dense (ARCHITECTURE.md 1, 2.1, 3.1).

Config spellings: released configs nest the KDA sizes in ``linear_attn_config`` (``kda_layers`` and
``full_attn_layers`` 1-indexed) and spell the MoE keys ``num_experts`` / ``num_experts_per_token`` /
``num_shared_experts`` / ``moe_renormalize`` / ``num_expert_group``; transformers also writes
``layer_types`` / ``mlp_layer_types`` and ``linear_num_heads`` / ``linear_head_dim``. Checkpoints hold the
MoE under ``block_sparse_moe`` with experts ``w1`` (gate) / ``w3`` (up) / ``w2`` (down).
"""
from __future__ import annotations

from dayzero.config.spec import KDASpec, LayerSpec, MLASpec, ModelSpec, MoESpec
from dayzero.loader.rules import Rule
from dayzero.models.adapters.common import (
    L, attn_rules, base_rules, dense_mlp_spec, dtype_of, eos_of, expert_rules, fused_gate_up, get,
)
from dayzero.models.registry import Adapter, register


def _layer_types(raw: dict) -> list[str]:
    n, lin = raw["num_hidden_layers"], raw.get("linear_attn_config") or {}
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    if "kda_layers" in lin and "full_attn_layers" in lin:
        types = [None] * n
        for i in lin["full_attn_layers"]:
            types[i - 1] = "full_attention"
        for i in lin["kda_layers"]:
            types[i - 1] = "linear_attention"
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        if missing:
            raise ValueError(f"linear_attn_config names no attention kind for layer(s) {missing} (1-indexed)")
        return types
    return ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]  # transformers' default


def _is_moe(raw: dict, i: int) -> bool:
    if raw.get("mlp_layer_types"):
        return raw["mlp_layer_types"][i] == "sparse"
    return i >= raw.get("first_k_dense_replace", 1) and i % (raw.get("moe_layer_freq") or 1) == 0


def _kda(raw: dict) -> KDASpec:
    lin = raw.get("linear_attn_config") or {}
    return KDASpec(get(lin, "num_heads", default=get(raw, "linear_num_heads", default=32)),
                   get(lin, "head_dim", default=get(raw, "linear_head_dim", default=128)),
                   get(lin, "short_conv_kernel_size", default=get(raw, "linear_conv_kernel_dim", default=4)))


def _mla(raw: dict) -> MLASpec:
    if raw.get("mla_use_nope") is False:
        raise ValueError("kimi_linear with mla_use_nope=false (RoPE in the MLA layers) is not supported")
    if get(raw, "num_key_value_heads", default=raw["num_attention_heads"]) != raw["num_attention_heads"]:
        raise ValueError("kimi_linear MLA needs num_key_value_heads == num_attention_heads")
    nope, rope_dim = raw["qk_nope_head_dim"], raw["qk_rope_head_dim"]
    # NoPE: the k_pe part of the latent is kept and shared by all heads, but never rotated. The latents are
    # normalised with eps 1e-6 (the DeepSeek convention), not rms_norm_eps.
    return MLASpec(raw["num_attention_heads"], raw.get("q_lora_rank"), raw["kv_lora_rank"], nope, rope_dim,
                   raw["v_head_dim"], rope=None, scale=(nope + rope_dim) ** -0.5, bias=raw.get("attention_bias", False),
                   latent_norm_eps=1e-6)


def _moe(raw: dict) -> MoESpec:
    act = raw.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise ValueError(f"kimi_linear router activation {act!r} is not supported; supported: sigmoid")
    inter, n_shared = raw["moe_intermediate_size"], get(raw, "num_shared_experts", "n_shared_experts", default=0)
    return MoESpec(
        get(raw, "num_experts", "num_local_experts", "n_routed_experts"), get(raw, "num_experts_per_token", "num_experts_per_tok"),
        inter, router="sigmoid", correction_bias=True, n_group=get(raw, "num_expert_group", "n_group", default=1),
        topk_group=get(raw, "topk_group", default=1), norm_topk_prob=get(raw, "moe_renormalize", "norm_topk_prob", default=True),
        routed_scaling_factor=raw.get("routed_scaling_factor", 1.0), n_shared=n_shared, shared_intermediate_size=n_shared * inter,
    )


def kimi_linear_spec(raw: dict) -> ModelSpec:
    types, kda, mla, moe = _layer_types(raw), _kda(raw), _mla(raw), _moe(raw)
    layers = tuple(
        LayerSpec(i, mla if t == "full_attention" else kda, moe if _is_moe(raw, i) else dense_mlp_spec(raw))
        for i, t in enumerate(types)
    )
    return ModelSpec(
        raw["model_type"], raw["vocab_size"], raw["hidden_size"], layers,
        get(raw, "max_position_embeddings", "model_max_length", default=1 << 20), raw.get("rms_norm_eps", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", False), torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw),
        bos_token_id=raw.get("bos_token_id"),
    )


def kimi_linear_rules(spec: ModelSpec) -> list[Rule]:
    # released checkpoints say block_sparse_moe (MoE) and mlp (dense); transformers saves both as block_sparse_moe
    moe = "(?:block_sparse_moe|mlp)"
    return base_rules() + expert_rules(moe, gate="(?:w1|gate_proj)", up="(?:w3|up_proj)", down="(?:w2|down_proj)") + [
        *fused_gate_up(f"{moe}\\.shared_experts", "mlp.shared_experts"), *fused_gate_up(moe, "mlp"),
        # vLLM and the released checkpoints store A_log as [1, 1, H, 1]
        Rule(rf"{L}\.self_attn\.A_log", "model.layers.{0}.self_attn.A_log", transform=lambda t: t.reshape(-1)),
    ] + attn_rules()


register(Adapter("kimi_linear", kimi_linear_spec, kimi_linear_rules, notes="KDA + NoPE MLA + sigmoid MoE + shared experts"))
