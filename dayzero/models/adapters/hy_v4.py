"""HY-V4 (Hunyuan 4): gated DSA on every layer, with IndexCache, a sigmoid-routed MoE with clamped SwiGLU
experts, and hyper-connections carrying ``hc_mult`` residual streams (``models/hyper.py``).

Read from transformers ``models/hy_v4`` (the parity reference):
- attention is DeepSeek-V3.2's MLA + lightning indexer, with RoPE in interleaved pairs in both (transformers
  before 5.25 rotated NeoX halves; a config's ``rope_interleave: false`` selects that layout), a per-head fp32 sink logit in the softmax denominator (``learnable_sink_param``), and an output gate
  ``o * sigmoid(linear_gate x)`` before ``o_proj`` reading the layer's normalised input (``[H*v_head_dim, D]``;
  a ``gating_type: "headwise"`` config gives one gate per head, ``[H, D]``);
- the indexer rotates the LAST ``qk_rope_head_dim`` dims of its q and k, and its ``k_norm`` uses
  ``rms_norm_eps``;
- ``indexer_types`` "shared" layers reuse the nearest earlier "full" layer's top-k; the default schedule is
  full at layer 0 and every 4th layer from 1;
- routed experts clamp SwiGLU's inputs at ``swiglu_limit`` (gate <= limit, |up| <= limit); shared experts
  and the dense MLP do not. transformers' code clamps even at limit <= 0, which its docs call "disabled":
  here a limit <= 0 disables the clamp;
- every sublayer reads and writes the ``hc_mult`` streams through a hyper-connection (``ops/hyper``), and a
  pre-only connection collapses them before the final norm.

Checkpoint names: the release spells ``linear_gate`` (every ``gate_proj``, MLP ones included, as
transformers writes them back), ``learnable_sink_param``, ``hc_pre.hc_{attn,mlp}_layer.hc_{fn,base,scale}``
and ``hc_pre.hc_head.hc_head_{fn,base,scale}``; transformers' in-memory names (``gate_proj``, ``sinks``,
``attn_hc.fn``, ``hc_head.hc_fn``...) load too. Routed experts are fused (``experts.gate_up_proj`` [E, 2I, D])
or one tensor per expert. MLA's latent RMSNorms use eps 1e-6 whatever ``rms_norm_eps`` says, as in the
DeepSeek family (``deepseek.mla_spec``).
"""
from __future__ import annotations

from dataclasses import replace

from dayzero.config.spec import HyperSpec, LayerSpec, ModelSpec
from dayzero.loader.rules import Rule
from dayzero.models.adapters.common import L, attn_rules, base_rules, dense_mlp_spec, expert_rules, fused_gate_up
from dayzero.models.adapters.deepseek import indexer_spec, mla_spec, model_spec, moe_spec
from dayzero.models.adapters.dsa import indexer_types
from dayzero.models.registry import Adapter, register

# HYV4Config defaults for keys a config may leave out
DEFAULTS = {"rms_norm_eps": 1e-5, "hc_mult": 4, "hc_magnitude": 2.0, "hc_eps": 1e-6, "swiglu_limit": 10.0,
            "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 16, "gating_type": "elementwise"}


def _kinds(raw: dict, key: str, default: list[str], allowed: set[str]) -> list[str]:
    n = raw["num_hidden_layers"]
    kinds = raw.get(key) or default
    if len(kinds) != n or set(kinds) - allowed:
        raise ValueError(f"hy_v4: {key} must list {n} of {sorted(allowed)}, got {kinds}")
    return list(kinds)


def hy_v4_spec(raw: dict) -> ModelSpec:
    raw = {**DEFAULTS, "rope_interleave": True, **{k: v for k, v in raw.items() if v is not None}}
    n = raw["num_hidden_layers"]
    # transformers 5.17 writes "deepseek_sparse_attention", later versions "indexed_attention": both are DSA
    _kinds(raw, "layer_types", ["indexed_attention"] * n, {"indexed_attention", "deepseek_sparse_attention"})
    mlps = _kinds(raw, "mlp_layer_types", ["dense"] + ["sparse"] * (n - 1), {"dense", "sparse"})
    default_index = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(n)]
    index = indexer_types({**raw, "indexer_types": raw.get("indexer_types") or default_index})
    if raw["gating_type"] not in ("elementwise", "headwise"):
        raise ValueError(f"hy_v4: gating_type {raw['gating_type']!r} is not supported; supported: elementwise, headwise")

    def attn(kind: str):
        ispec = indexer_spec(raw, interleaved=raw["rope_interleave"], shared=kind == "shared")
        ispec = replace(ispec, rope=replace(ispec.rope, last=True), norm_eps=raw["rms_norm_eps"])
        return replace(mla_spec(raw, ispec), output_gate=True, output_gate_kind=raw["gating_type"], sinks=True)

    attns = {k: attn(k) for k in set(index)}
    limit = raw["swiglu_limit"]
    moe = replace(moe_spec(raw), swiglu_limit=limit if limit > 0 else None)
    dense = dense_mlp_spec(raw)
    layers = (LayerSpec(i, attns[index[i]], moe if mlps[i] == "sparse" else dense) for i in range(n))
    return replace(model_spec(raw, layers), hyper=HyperSpec(raw["hc_mult"], raw["hc_eps"], raw["hc_magnitude"]))


GATE = "(?:gate_proj|linear_gate)"  # transformers writes every gate_proj back as linear_gate


def hy_v4_rules(spec: ModelSpec) -> list[Rule]:
    attn, hc = rf"{L}\.self_attn", r"(?:hc_pre\.)?"
    return base_rules() + expert_rules() + [
        *fused_gate_up(r"mlp\.shared_experts", "mlp.shared_experts", gate=GATE),
        *fused_gate_up("mlp", "mlp", gate=GATE),
        Rule(rf"{attn}\.{GATE}\.weight", "model.layers.{0}.self_attn.g_proj.weight"),
        Rule(rf"{attn}\.(?:sinks|learnable_sink_param)", "model.layers.{0}.self_attn.sinks"),
        Rule(rf"{L}\.{hc}hc_attn_layer\.hc_(fn|base|scale)", "model.layers.{0}.attn_hc.{1}"),
        Rule(rf"{L}\.{hc}hc_mlp_layer\.hc_(fn|base|scale)", "model.layers.{0}.ffn_hc.{1}"),
        Rule(rf"{L}\.(attn|ffn)_hc\.(fn|base|scale)", "model.layers.{0}.{1}_hc.{2}"),
        Rule(rf"model\.{hc}hc_head\.hc_(?:head_)?(fn|base|scale)", "model.hc_head.{0}"),
    ] + attn_rules()


register(Adapter(
    "hy_v4", hy_v4_spec, hy_v4_rules, ignore=(r"model\.mtp_layers\..*",),
    notes="gated DSA (sinks, sigmoid output gate, IndexCache) + sigmoid MoE with clamped SwiGLU + hyper-connections",
))
