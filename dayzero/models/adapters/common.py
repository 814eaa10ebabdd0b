"""What adapters share: reading Hugging Face config spellings (and the text model of a vision-language config),
and the name-table fragments most families reuse (embeddings and norms, dense MLPs, routed and shared experts in
every stored layout, all nested under a vision-language model's prefix)."""
from __future__ import annotations

import dataclasses

from dayzero.config.spec import MLPSpec, RopeScaling, RopeSpec
from dayzero.loader.rules import Rule, expert, rows, same

L = r"model\.layers\.(\d+)"  # group 1 of every per-layer rule is the layer index
# transformers 5 vision-language models hold the text model as ``model.language_model`` (LM head at the top)
LANGUAGE_MODEL = {r"model\.": r"model\.language_model\."}


def get(raw: dict, *names, default=None):
    """The first of ``names`` present in the config (released configs and transformers 5 spell some keys differently)."""
    for n in names:
        if n in raw and raw[n] is not None:
            return raw[n]
    return default


def dtype_of(raw: dict) -> str:
    d = get(raw, "torch_dtype", "dtype", default="bfloat16")
    return d if d in ("float32", "bfloat16", "float16") else "bfloat16"


def eos_of(raw: dict) -> tuple[int, ...]:
    e = raw.get("eos_token_id")
    return () if e is None else (tuple(e) if isinstance(e, list) else (e,))


def text_config(raw: dict) -> dict:
    """The language model of a vision-language config: ``text_config``, filled in from the outer config where it
    says nothing (dtype, quantization, token ids), under the outer ``model_type``. The outer
    ``tie_word_embeddings`` decides, as transformers ties the whole model's head by it."""
    text = {k: v for k, v in (raw.get("text_config") or {}).items() if v is not None}
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config") and v is not None}
    tie = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
    return {**outer, **text, **tie, "model_type": raw["model_type"]}


def rope_params(raw: dict) -> dict:
    """``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling`` (released configs), merged."""
    p = dict(raw.get("rope_scaling") or {})
    p.update(raw.get("rope_parameters") or {})
    if "rope_theta" not in p:
        p["rope_theta"] = raw.get("rope_theta", 10000.0)
    if "partial_rotary_factor" not in p and "partial_rotary_factor" in raw:
        p["partial_rotary_factor"] = raw["partial_rotary_factor"]
    return p


def rope_spec(raw: dict, head_dim: int, interleaved: bool = False, dim: int | None = None) -> RopeSpec:
    p = rope_params(raw)
    kind = p.get("rope_type", p.get("type", "default"))
    if dim is None:
        dim = int(head_dim * p.get("partial_rotary_factor", 1.0))
    scaling = None
    if kind == "yarn":
        scaling = RopeScaling(
            factor=p["factor"], original_max_position_embeddings=p["original_max_position_embeddings"],
            beta_fast=p.get("beta_fast") or 32.0, beta_slow=p.get("beta_slow") or 1.0,
            mscale=p.get("mscale") or 0.0, mscale_all_dim=p.get("mscale_all_dim") or 0.0,
            attention_factor=p.get("attention_factor"), truncate=p.get("truncate", True),
        )
    elif kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported yet; supported: default, yarn")
    mrope = p.get("mrope_section")
    return RopeSpec(dim, p["rope_theta"], scaling, interleaved, mrope_section=tuple(mrope) if mrope else None)


def dense_mlp_spec(raw: dict, size: int | None = None) -> MLPSpec:
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported for the dense MLP; supported: silu")
    return MLPSpec(size or raw["intermediate_size"])


# --- name-table fragments ------------------------------------------------------------------------------
def base_rules() -> list[Rule]:
    return [
        Rule(r"model\.embed_tokens\.weight", "model.embed_tokens.weight"),
        Rule(r"model\.norm\.weight", "model.norm.weight"),
        Rule(r"lm_head\.weight", "lm_head.weight"),
        Rule(rf"{L}\.(input_layernorm|post_attention_layernorm)\.weight", "model.layers.{0}.{1}.weight"),
    ]


def attn_rules(src: str = "self_attn") -> list[Rule]:
    """Attention submodules whose names match ours (q_proj, kv_a_proj_with_mqa, q_norm, sinks, ...)."""
    return [Rule(rf"{L}\.{src}\.(.+)", "model.layers.{0}.self_attn.{1}")]


def nested(rules: list[Rule], prefixes: dict[str, str]) -> list[Rule]:
    r"""``rules`` for a checkpoint that nests the text model in a vision-language model: a pattern that starts with
    a key of ``prefixes`` (the first that matches, e.g. ``model\.``) starts with its value instead
    (``model\.language_model\.``)."""
    out = []
    for r in rules:
        old = next((k for k in prefixes if r.pattern.startswith(k)), None)
        out.append(r if old is None else dataclasses.replace(r, pattern=prefixes[old] + r.pattern[len(old):]))
    return out


def fused_gate_up(prefix: str, dst: str, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj") -> list[Rule]:
    """A dense gated MLP stored as separate gate/up/down into our fused [gate; up] + down (with block-FP8
    ``weight_scale_inv`` tiles split the same way)."""
    w = r"(weight|weight_scale_inv)"
    return [
        Rule(rf"{L}\.{prefix}\.{gate}\.{w}", f"model.layers.{{0}}.{dst}.gate_up_proj.{{1}}", rows(0, 2)),
        Rule(rf"{L}\.{prefix}\.{up}\.{w}", f"model.layers.{{0}}.{dst}.gate_up_proj.{{1}}", rows(1, 2)),
        Rule(rf"{L}\.{prefix}\.{down}\.{w}", f"model.layers.{{0}}.{dst}.down_proj.{{1}}"),
    ]


def expert_rules(prefix: str = "mlp", experts: str = "experts", gate: str = "gate_proj", up: str = "up_proj",
                 down: str = "down_proj", router: str = "gate") -> list[Rule]:
    """Routed experts one tensor per expert (``experts.{e}.gate_proj.weight``) or fused as transformers
    holds them in memory (``experts.gate_up_proj`` [E, 2I, D], ``experts.down_proj`` [E, D, I]); router
    weight and correction bias."""
    dst = "model.layers.{0}.mlp"
    return [
        # weight, or its block-FP8 tile scales (weight_scale_inv -> w1_scale_inv)
        Rule(rf"{L}\.{prefix}\.{experts}\.(\d+)\.{gate}\.weight((?:_scale_inv)?)", f"{dst}.w1{{2}}", rows(0, 2, expert_group=2)),
        Rule(rf"{L}\.{prefix}\.{experts}\.(\d+)\.{up}\.weight((?:_scale_inv)?)", f"{dst}.w1{{2}}", rows(1, 2, expert_group=2)),
        Rule(rf"{L}\.{prefix}\.{experts}\.(\d+)\.{down}\.weight((?:_scale_inv)?)", f"{dst}.w2{{2}}", expert(2)),
        Rule(rf"{L}\.{prefix}\.{experts}\.gate_up_proj", f"{dst}.w1", transform=same),
        Rule(rf"{L}\.{prefix}\.{experts}\.down_proj", f"{dst}.w2"),
        Rule(rf"{L}\.{prefix}\.{router}\.weight", f"{dst}.gate.weight"),
        Rule(rf"{L}\.{prefix}\.{router}\.e_score_correction_bias", f"{dst}.e_score_correction_bias"),
    ]


def moe_layer_rules(prefix: str = "mlp", shared: str = "shared_experts", **names) -> list[Rule]:
    """Experts + shared experts + the dense MLP of non-MoE layers, all under ``prefix``."""
    return (expert_rules(prefix, **names) + fused_gate_up(f"{prefix}\\.{shared}", "mlp.shared_experts")
            + fused_gate_up(prefix, "mlp"))


def weight_format(raw: dict) -> tuple[str, tuple[str, ...]]:
    """("fp8_block", modules kept high) for DeepSeek-style block-FP8 checkpoints, else ("dense", ())."""
    q = raw.get("quantization_config") or {}
    method = q.get("quant_method")
    if method is None:
        return "dense", ()
    if method != "fp8":
        raise ValueError(f"quantization method {method!r} is not supported for {raw.get('model_type')}; supported: fp8")
    block = q.get("weight_block_size", [128, 128])
    if list(block) != [128, 128]:
        raise ValueError(f"block-FP8 weights need weight_block_size [128, 128], got {block}")
    return "fp8_block", tuple(q.get("modules_to_not_convert") or ())
