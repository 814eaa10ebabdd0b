"""gpt-oss: GQA with q/k/v/o biases and attention sinks, sliding-window and full layers alternating
(``layer_types``), YaRN RoPE (``truncate=False`` in the release), and a MoE of biased experts with the
clamped SwiGLU (``swiglu_oai``), routed by softmax over the top-k logits of a biased router.

Expert weights load packed from MXFP4 checkpoints (``quantization_config.quant_method == "mxfp4"``:
``experts.gate_up_proj_blocks`` [E, 2I, D/32, 16] + ``_scales`` [E, 2I, D/32] with gate/up rows interleaved,
``experts.down_proj_blocks`` [E, D, I/32, 16] + ``_scales``; they stay packed and run through the expert
workspace), or from bf16/fp32 tensors in any of these layouts:
- fused, as transformers holds and saves them: ``experts.gate_up_proj`` [E, D, 2I] and its bias [E, 2I]
  with gate/up INTERLEAVED along 2I (even = gate, odd = up), ``experts.down_proj`` [E, I, D] + bias [E, D];
- fused [E, out, in] (``gate_up_proj`` [E, 2I, D], still interleaved; ``down_proj`` [E, D, I]), the
  orientation the MXFP4 release dequantises to; told apart from the above by shape (square ones are read
  as transformers writes them);
- one tensor per expert: ``experts.{e}.{gate,up,down}_proj.{weight,bias}``.
"""
from __future__ import annotations

from dayzero.config.spec import GQASpec, LayerSpec, ModelSpec, MoESpec
from dayzero.loader.rules import (
    Rule, as_out_in, chain, deinterleave_last, deinterleave_packed_rows, deinterleave_rows, expert, rows,
)
from dayzero.models.adapters.common import L, attn_rules, base_rules, dtype_of, eos_of, get, rope_params, rope_spec
from dayzero.models.registry import Adapter, register

# transformers' GptOssConfig defaults, used when a config leaves them out
ROPE_THETA = 150000.0
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}
SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # the constants the swiglu_oai op computes with


def _rope(raw: dict, head_dim: int):
    p = rope_params({**raw, "rope_theta": raw.get("rope_theta", ROPE_THETA)})
    if p.get("rope_type", p.get("type")) is None:  # no scaling given: transformers' default is YaRN
        p = {**YARN, **p}
    return rope_spec({**raw, "rope_scaling": None, "rope_parameters": p}, head_dim)


def _expert_format(raw: dict) -> str:
    method = (raw.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ValueError(f"gpt_oss: quantization method {method!r} is not supported; supported: mxfp4")
    return "mxfp4" if method == "mxfp4" else "dense"


def gpt_oss_spec(raw: dict) -> ModelSpec:
    for key, value in SWIGLU.items():
        if raw.get(key, value) != value:
            raise ValueError(f"gpt_oss: {key}={raw[key]} is not supported; the swiglu_oai experts compute with {value}")
    n_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != n_layers:
        raise ValueError(f"gpt_oss: layer_types must list {n_layers} of sliding_attention/full_attention, got {types}")
    hd = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    bias = raw.get("attention_bias", True)
    rope = _rope(raw, hd)

    def attn(window):
        return GQASpec(raw["num_attention_heads"], get(raw, "num_key_value_heads", "num_attention_heads"), hd, rope,
                       qkv_bias=bias, o_bias=bias, sliding_window=window, sinks=True)

    moe = MoESpec(
        get(raw, "num_local_experts", "num_experts"), get(raw, "num_experts_per_tok", "experts_per_token"),
        raw["intermediate_size"], router="softmax_topk", correction_bias=False, router_bias=True,
        activation="swiglu_oai", expert_bias=True, expert_format=_expert_format(raw),
    )
    window = raw.get("sliding_window")
    layers = tuple(LayerSpec(i, attn(window if t == "sliding_attention" else None), moe) for i, t in enumerate(types))
    return ModelSpec(
        "gpt_oss", raw["vocab_size"], raw["hidden_size"], layers, raw["max_position_embeddings"],
        raw.get("rms_norm_eps", 1e-5), tie_word_embeddings=raw.get("tie_word_embeddings", False),
        torch_dtype=dtype_of(raw), eos_token_id=eos_of(raw), bos_token_id=raw.get("bos_token_id"),
    )


def gpt_oss_rules(spec: ModelSpec) -> list[Rule]:
    moe = next(l.mlp for l in spec.layers)
    D, I = spec.hidden_size, moe.intermediate_size
    src, dst = rf"{L}\.mlp\.experts", "model.layers.{0}.mlp"
    per_expert = [  # one tensor per expert, as nn.Linear stores them: weights [I, D] / [D, I]
        Rule(rf"{src}\.(\d+)\.{name}\.{kind}", f"{dst}.{param}{n}", view)
        for name, n, view in (("gate_proj", 1, rows(0, 2, expert_group=2)), ("up_proj", 1, rows(1, 2, expert_group=2)),
                              ("down_proj", 2, expert(2)))
        for kind, param in (("weight", "w"), ("bias", "b"))
    ]
    return base_rules() + attn_rules() + per_expert + [
        Rule(rf"{L}\.mlp\.router\.(weight|bias)", "model.layers.{0}.mlp.gate.{1}"),
        # fused stacks: gate/up interleaved along 2I, weights in either orientation
        Rule(rf"{src}\.gate_up_proj", f"{dst}.w1", transform=chain(as_out_in(2 * I, D), deinterleave_rows)),
        Rule(rf"{src}\.gate_up_proj_bias", f"{dst}.b1", transform=deinterleave_last),
        Rule(rf"{src}\.down_proj", f"{dst}.w2", transform=as_out_in(D, I)),
        Rule(rf"{src}\.down_proj_bias", f"{dst}.b2"),
        # MXFP4: [E, out, in/32, 16] codes and [E, out, in/32] scales, gate/up rows interleaved
        Rule(rf"{src}\.gate_up_proj_blocks", f"{dst}.w1_blocks", transform=deinterleave_packed_rows),
        Rule(rf"{src}\.gate_up_proj_scales", f"{dst}.w1_scales", transform=deinterleave_rows),
        Rule(rf"{src}\.down_proj_(blocks|scales)", f"{dst}.w2_{{1}}"),
    ]


register(Adapter("gpt_oss", gpt_oss_spec, gpt_oss_rules,
                 notes="GQA + sinks + sliding/full layers + YaRN; softmax-top-k MoE with biased swiglu_oai experts"))
