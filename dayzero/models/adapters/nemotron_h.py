"""Nemotron-H and Nemotron 3 (LatentMoE): a hybrid whose layers each hold one mixer, ``x + mixer(norm(x))``,
chosen per layer by ``layers_block_type`` (``hybrid_override_pattern`` in released configs):

    M  Mamba-2 mixer                               -> LayerSpec(attn=Mamba2Spec, mlp=None)
    *  GQA attention, no positional encoding       -> LayerSpec(attn=GQASpec(rope=None), mlp=None)
    -  ReLU² MLP (not gated)                       -> LayerSpec(attn=None, mlp=MLPSpec)
    E  sigmoid-routed ReLU² MoE + a shared expert, -> LayerSpec(attn=None, mlp=MoESpec)
       experts at ``moe_latent_size`` when it is set (ARCHITECTURE.md 3.3)

Checkpoints name tensors ``backbone.`` (released) or ``model.`` (transformers in memory); experts are one
tensor per expert (released) or stacked ``experts.up_proj`` [E, I, L] / ``experts.down_proj`` [E, L, I].
"""
from __future__ import annotations

import math
from dataclasses import replace

from dayzero.config.spec import GQASpec, LayerSpec, MLPSpec, ModelSpec, MoESpec
from dayzero.config.spec import Mamba2Spec
from dayzero.loader.rules import Rule, expert
from dayzero.models.adapters.common import dtype_of, eos_of, get
from dayzero.models.adapters.deepseek import moe_spec
from dayzero.models.registry import Adapter, register

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
MIXER_KINDS = ("linear_attention", "full_attention")


def layer_kinds(raw: dict) -> list[str]:
    kinds = get(raw, "layers_block_type", "layer_types")
    if kinds is None:
        pattern = raw.get("hybrid_override_pattern")
        if pattern is None or set(pattern) - set(PATTERN):
            raise ValueError(f"nemotron_h config needs layers_block_type or a hybrid_override_pattern of "
                             f"{''.join(PATTERN)}, got {pattern!r}")
        kinds = [PATTERN[c] for c in pattern]
    kinds = [LEGACY.get(k, k) for k in kinds]
    bad = sorted(set(kinds) - set(PATTERN.values()))
    if bad:
        raise ValueError(f"layers_block_type has unknown kinds {bad}; supported: {sorted(PATTERN.values())}")
    return kinds


def _float(v) -> float:
    # transformers 5 writes infinity as {"__float__": "Infinity"}; released configs as a bare Infinity
    return float(v["__float__"]) if isinstance(v, dict) else float(v)


def _mamba(raw: dict) -> Mamba2Spec:
    if raw.get("mamba_hidden_act", "silu") != "silu":
        raise ValueError(f"mamba_hidden_act {raw['mamba_hidden_act']!r} is not supported; supported: silu")
    lo, hi = get(raw, "time_step_limit", "mamba_dt_limit", default=(0.0, math.inf))
    # transformers clamps dt at time_step_min during prefill only; time_step_min/max are the dt_bias init
    # range, and vLLM and mamba_ssm use time_step_limit (default no clamp), as here.
    return Mamba2Spec(
        raw["mamba_num_heads"], raw["mamba_head_dim"], raw["ssm_state_size"], get(raw, "n_groups", "mamba_n_groups", default=8),
        get(raw, "conv_kernel", "mamba_d_conv", default=4), get(raw, "chunk_size", "mamba_chunk_size", default=128),
        (_float(lo), _float(hi)), get(raw, "use_conv_bias", "mamba_conv_bias", default=True), raw.get("use_bias", False),
    )


def _act(raw: dict) -> str:
    act = raw.get("mlp_hidden_act", "relu2")
    if act != "relu2":
        raise ValueError(f"mlp_hidden_act {act!r} is not supported; supported: relu2")
    return act


def _moe(raw: dict) -> MoESpec:
    """DeepSeek-style sigmoid routing (ARCHITECTURE.md 3.3), with ReLU² experts, one shared expert of its own
    width and the optional latent width."""
    shared = raw.get("moe_shared_expert_intermediate_size") or 0
    return replace(moe_spec(raw), activation=_act(raw), n_shared=1 if shared else 0, shared_intermediate_size=shared,
                   latent_size=raw.get("moe_latent_size"))


def nemotron_h_spec(raw: dict) -> ModelSpec:
    D = raw["hidden_size"]
    attn = GQASpec(raw["num_attention_heads"], get(raw, "num_key_value_heads", "num_attention_heads"),
                   raw.get("head_dim") or D // raw["num_attention_heads"], rope=None)
    build = {
        "linear_attention": lambda i: LayerSpec(i, _mamba(raw), None),
        "full_attention": lambda i: LayerSpec(i, attn, None),
        "mlp": lambda i: LayerSpec(i, None, MLPSpec(raw["intermediate_size"], _act(raw), raw.get("mlp_bias", False))),
        "moe": lambda i: LayerSpec(i, None, _moe(raw)),
    }
    layers = tuple(build[k](i) for i, k in enumerate(layer_kinds(raw)))
    return ModelSpec(
        raw["model_type"], raw["vocab_size"], D, layers, raw["max_position_embeddings"], raw.get("layer_norm_epsilon", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", False), torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw),
        bos_token_id=raw.get("bos_token_id"),
    )


def _prefix(indices: list[int]) -> str:
    """Checkpoint prefix of these layers (group 1 = the layer index); matches nothing for no layers."""
    return rf"(?:backbone|model)\.layers\.({'|'.join(map(str, indices)) or '(?!)'})"


def nemotron_h_rules(spec: ModelSpec) -> list[Rule]:
    M = _prefix([l.index for l in spec.layers if l.attn is not None])  # Mamba-2 and attention layers
    F = _prefix([l.index for l in spec.layers if l.attn is None])  # MLP and MoE layers
    ffn = "model.layers.{0}.mlp"
    return [
        Rule(r"(?:backbone|model)\.embeddings\.weight", "model.embed_tokens.weight"),
        Rule(r"(?:backbone|model)\.norm_f\.weight", "model.norm.weight"),
        Rule(r"lm_head\.weight", "lm_head.weight"),
        Rule(rf"{M}\.norm\.weight", "model.layers.{0}.input_layernorm.weight"),
        Rule(rf"{M}\.mixer\.(.+)", "model.layers.{0}.self_attn.{1}"),  # Mamba-2 and attention names match ours
        Rule(rf"{F}\.norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
        # routed experts: one tensor per expert, or stacked; ReLU² experts have no gate, so w1 is up alone
        Rule(rf"{F}\.mixer\.experts\.(\d+)\.up_proj\.weight", f"{ffn}.w1", expert(2)),
        Rule(rf"{F}\.mixer\.experts\.(\d+)\.down_proj\.weight", f"{ffn}.w2", expert(2)),
        Rule(rf"{F}\.mixer\.experts\.up_proj", f"{ffn}.w1"),
        Rule(rf"{F}\.mixer\.experts\.down_proj", f"{ffn}.w2"),
        Rule(rf"{F}\.mixer\.gate\.e_score_correction_bias", f"{ffn}.e_score_correction_bias"),
        # dense and shared-expert MLPs keep their up projection in our gate_up_proj (no gate for ReLU²)
        Rule(rf"{F}\.mixer\.up_proj\.(weight|bias)", ffn + ".gate_up_proj.{1}"),
        Rule(rf"{F}\.mixer\.shared_experts\.up_proj\.(weight|bias)", ffn + ".shared_experts.gate_up_proj.{1}"),
        Rule(rf"{F}\.mixer\.(.+)", ffn + ".{1}"),  # gate, fc1/fc2_latent_proj, down_proj
    ]


register(Adapter(
    "nemotron_h", nemotron_h_spec, nemotron_h_rules,
    ignore=(r"mtp\..*",),  # multi-token-prediction layers are for speculative decoding, not loaded yet
    notes="Mamba-2 + NoPE GQA + ReLU² MLP + sigmoid (Latent)MoE with shared experts, one mixer per layer",
))
