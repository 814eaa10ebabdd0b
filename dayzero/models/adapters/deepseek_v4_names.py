"""DeepSeek-V4 checkpoint names: the release's and transformers'.

The release (and transformers' save_pretrained, which writes the same names, some with a ``model.``
prefix) spells ``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_fn``, ``layers.0.attn_norm``,
``layers.0.hc_attn_fn``, ``layers.0.attn.{wq_a, q_norm, wq_b, wkv, norm, wo_a, wo_b, attn_sink}``,
``attn.compressor.{wkv, wgate, norm, ape}``, ``attn.indexer.{wq_b, weights_proj, compressor.*}`` and
``ffn.{gate.weight, gate.bias, gate.tid2eid, experts.E.w1/w3/w2, shared_experts.w1/w3/w2}``. Its formats:
linears in FP8 E4M3 with UE8M0 128×128 tile scales (``.scale``; the compressors' projections and the
indexer's weights_proj stay BF16), routed experts as packed FP4 (two E2M1 codes per int8 byte, the first in
the low nibble) with UE8M0 scales per 32 values, kept here as MXFP4 codes, or FP8 like the linears.
transformers' in-memory names (``self_attn.compressor.indexer.scorer.weights_proj``, ``attn_hc.fn``, fused
``experts.gate_up_proj``...) load too.
"""
from __future__ import annotations

from dayzero.config.spec import ModelSpec, MoESpec
from dayzero.loader.rules import Rule, as_bytes, e8m0_to_float, expert, fp4_pairs_to_blocks, rows, whole
from dayzero.models.adapters.common import L, attn_rules, base_rules, expert_rules, fused_gate_up

LP = r"(?:model\.)?layers\.(\d+)"  # released names have no ``model.`` prefix; transformers writes them with one
DST = "model.layers.{0}"
# released (DeepSeek) name -> ours, under ``attn.``, ``attn.compressor.`` and ``attn.indexer.compressor.``
ATTN = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "norm": "kv_norm",
        "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}


def _linear(src: str, dst: str, view=whole) -> list[Rule]:
    """A linear's weight and, where the release stores it in FP8, its UE8M0 128×128 tile scales (``.scale``)."""
    return [Rule(rf"{src}\.weight", f"{dst}.weight", view),
            Rule(rf"{src}\.scale", f"{dst}.weight_scale_inv", view, e8m0_to_float)]


def _renamed(src: str, dst: str, names: dict[str, str]) -> list[Rule]:
    return [r for a, b in names.items() for r in _linear(rf"{LP}\.{src}\.{a}", f"{DST}.{dst}.{b}")]


def _expert_rules(ffn: str, fmt: str) -> list[Rule]:
    """Released experts ``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down), each ``.weight`` and, quantised,
    ``.scale``: packed FP4 + per-32 UE8M0 scales kept as MXFP4 codes, or FP8 + 128×128 UE8M0 tile scales."""
    packed = fmt == "mxfp4"
    weight, scale = ("_blocks", "_scales") if packed else ("", "_scale_inv")
    w_tf, s_tf = (fp4_pairs_to_blocks, as_bytes) if packed else (None, e8m0_to_float)
    axis = 0 if packed else None  # packed codes [2I, K/32, 16] have their rows first
    out = []
    for suffix, target, tf in (("weight", weight, w_tf), ("scale", scale, s_tf)):
        extra = {} if tf is None else {"transform": tf}
        for w, part in (("w1", 0), ("w3", 1)):
            out.append(Rule(rf"{ffn}\.experts\.(\d+)\.{w}\.{suffix}", f"{DST}.mlp.w1{target}",
                            rows(part, 2, expert_group=2, axis=axis), **extra))
        out.append(Rule(rf"{ffn}\.experts\.(\d+)\.w2\.{suffix}", f"{DST}.mlp.w2{target}", expert(2), **extra))
    return out


def deepseek_v4_rules(spec: ModelSpec) -> list[Rule]:
    """Released names (``layers.0.attn.wq_a.weight``, ``ffn.experts.0.w1``, ``hc_attn_fn``...), as the release
    and transformers' save_pretrained write them, and transformers' in-memory names."""
    ffn = rf"{LP}\.ffn"
    fmt = next((l.mlp.expert_format for l in spec.layers if isinstance(l.mlp, MoESpec)), "dense")
    shared = rf"{ffn}\.shared_experts", f"{DST}.mlp.shared_experts"
    released = [
        Rule(r"(?:model\.)?embed\.weight", "model.embed_tokens.weight"),
        Rule(r"head\.weight", "lm_head.weight"),
        Rule(r"(?:model\.)?norm\.weight", "model.norm.weight"),
        Rule(r"(?:model\.)?hc_head_(fn|base|scale)", "model.hc_head.{0}"),
        Rule(rf"{LP}\.attn_norm\.weight", f"{DST}.input_layernorm.weight"),
        Rule(rf"{LP}\.ffn_norm\.weight", f"{DST}.post_attention_layernorm.weight"),
        Rule(rf"{LP}\.hc_(attn|ffn)_(fn|base|scale)", f"{DST}.{{1}}_hc.{{2}}"),
        Rule(rf"{LP}\.attn\.attn_sink", f"{DST}.self_attn.sinks"),
        *_renamed("attn", "self_attn", ATTN),
        *_renamed(r"attn\.compressor", "self_attn.compressor", COMPRESSOR),
        *_renamed(r"attn\.indexer\.compressor", "self_attn.indexer.compressor", COMPRESSOR),
        Rule(rf"{LP}\.attn\.compressor\.ape", f"{DST}.self_attn.compressor.position_bias"),
        Rule(rf"{LP}\.attn\.indexer\.compressor\.ape", f"{DST}.self_attn.indexer.compressor.position_bias"),
        *_renamed(r"attn\.indexer", "self_attn.indexer", {"wq_b": "q_b_proj", "weights_proj": "weights_proj"}),
        Rule(rf"{ffn}\.gate\.weight", f"{DST}.mlp.gate.weight"),
        Rule(rf"{ffn}\.gate\.bias", f"{DST}.mlp.e_score_correction_bias"),
        Rule(rf"{ffn}\.gate\.tid2eid", f"{DST}.mlp.tid2eid"),
        *_expert_rules(ffn, fmt),
        *_linear(rf"{shared[0]}\.w1", f"{shared[1]}.gate_up_proj", rows(0, 2)),
        *_linear(rf"{shared[0]}\.w3", f"{shared[1]}.gate_up_proj", rows(1, 2)),
        *_linear(rf"{shared[0]}\.w2", f"{shared[1]}.down_proj"),
    ]
    attn = rf"{L}\.self_attn"
    in_memory = base_rules() + expert_rules() + [
        *fused_gate_up(r"mlp\.shared_experts", "mlp.shared_experts"),
        Rule(rf"{L}\.mlp\.gate\.tid2eid", f"{DST}.mlp.tid2eid"),
        Rule(rf"{attn}\.compressor\.indexer\.((?:kv_proj|gate_proj|kv_norm)\.weight|position_bias)",
             f"{DST}.self_attn.indexer.compressor.{{1}}"),
        Rule(rf"{attn}\.compressor\.indexer\.(?:scorer\.)?(q_b_proj|weights_proj)\.weight", f"{DST}.self_attn.indexer.{{1}}.weight"),
        Rule(rf"{L}\.(attn|ffn)_hc\.(fn|base|scale)", f"{DST}.{{1}}_hc.{{2}}"),
        Rule(r"model\.hc_head\.hc_(fn|base|scale)", "model.hc_head.{0}"),
    ] + attn_rules()
    return released + in_memory
