"""DeepSeek-V4: compressed attention (sliding window + HCA / CSA entries, ``layers/attention/compressed.py``),
a sqrt-softplus routed MoE whose first layers route by a token-id hash, and mHC hyper-connections
(Sinkhorn-projected stream mixing, ``ops/hyper``).

Read from transformers ``models/deepseek_v4`` (the parity reference):
- ``layer_types``: ``sliding_attention`` (window only), ``compressed_sparse_attention`` (CSA: ratio 4,
  overlapping windows, lightning indexer top-k), ``heavily_compressed_attention`` (HCA: ratio 128, every
  entry); released configs give ``compress_ratios`` per layer (0, 4: CSA, other: HCA) instead;
- RoPE is interleaved on the LAST ``head_dim * partial_rotary_factor`` channels (``qk_rope_head_dim`` in
  older configs); sliding layers use ``rope_theta`` without scaling, compressed layers, their compressors
  and the indexer use ``compress_rope_theta`` with the config's YaRN, whose cos/sin are NOT scaled by the
  YaRN attention factor (``attention_factor`` 1);
- ``mlp_layer_types``: ``hash_moe`` layers (the first ``num_hash_layers``, default 3) take their experts
  from ``tid2eid[token id]``; every routed and shared expert clamps SwiGLU at ``swiglu_limit``; weights are
  always renormalised over the chosen experts, then scaled by ``routed_scaling_factor``;
- the post weights of the hyper-connections carry no eps (HY-V4's do).
Checkpoint names: the release's (``layers.0.attn.wq_a``, ``attn.compressor.ape``, ``ffn.experts.0.w1``,
``hc_attn_fn``; transformers' save_pretrained writes these too, some with a ``model.`` prefix) and
transformers' in-memory ones (``self_attn.compressor.indexer.*``, ``attn_hc.fn``, fused experts).
Multi-token-prediction tensors (``mtp.*``) are not loaded.
"""
from __future__ import annotations

from dataclasses import replace

from dayzero.config.spec import CompressedAttnSpec, HyperSpec, IndexerSpec, LayerSpec, ModelSpec, MoESpec
from dayzero.loader.rules import Rule, as_bytes, e8m0_to_float, expert, fp4_pairs_to_blocks, rows, whole
from dayzero.models.adapters.common import L, attn_rules, base_rules, expert_rules, fused_gate_up, rope_spec, weight_format
from dayzero.models.adapters.deepseek import model_spec
from dayzero.models.registry import Adapter, register

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# DeepseekV4Config defaults for keys a config may leave out
DEFAULTS = {"head_dim": 512, "q_lora_rank": 1024, "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024,
            "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "swiglu_limit": 10.0, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
            "n_shared_experts": 1, "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rms_norm_eps": 1e-6,
            "num_hash_layers": 3}


def _schedule(raw: dict) -> tuple[list[str], dict[str, int], list[str]]:
    """Attention kind, compression ratio per kind and MLP kind of every layer, from either config spelling."""
    n = raw["num_hidden_layers"]
    rates = {CSA: 4, HCA: 128, **(raw.get("compress_rates") or {})}
    rates[CSA], rates[HCA] = raw.get("compress_rate_csa", rates[CSA]), raw.get("compress_rate_hca", rates[HCA])
    kinds = raw.get("layer_types")
    if kinds is None and raw.get("compress_ratios") is not None:
        # DeepSeek's reference: ratio 4 layers overlap their windows and run the indexer, other ratios do not
        ratios = list(raw["compress_ratios"])
        kinds = [SWA if r == 0 else CSA if r == 4 else HCA for r in ratios]
        heavy = {r for r in ratios if r not in (0, 4)}
        if len(heavy) > 1:
            raise ValueError(f"deepseek_v4: compress_ratios has several heavy ratios {sorted(heavy)}; one is supported")
        rates[HCA] = heavy.pop() if heavy else rates[HCA]
    if kinds is None:  # transformers' default: two HCA layers, then HCA / CSA alternating
        kinds = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    n_hash = raw["num_hash_layers"]
    mlps = raw.get("mlp_layer_types") or ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    for key, got, allowed in (("layer_types", kinds, {SWA, CSA, HCA}), ("mlp_layer_types", mlps, {"hash_moe", "moe"})):
        if len(got) < n or set(got[:n]) - allowed:
            raise ValueError(f"deepseek_v4: {key} must list {n} of {sorted(allowed)}, got {got}")
    return list(kinds[:n]), rates, list(mlps[:n])


def _ropes(raw: dict, rope_dim: int):
    """(main, compress) RoPE: interleaved on the last ``rope_dim`` channels; YaRN only on the compress one."""
    nested = raw.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict):
        main_p, compress_p = nested["main"], nested["compress"]
    else:  # released configs: rope_theta, compress_rope_theta and rope_scaling (yarn) at the top level
        scaling = {k: v for k, v in {**(raw.get("rope_scaling") or {}), **nested}.items() if k != "rope_theta"}
        main_p = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
        compress_p = {"rope_type": "default", **scaling, "rope_theta": raw["compress_rope_theta"]}
    if compress_p.get("rope_type", compress_p.get("type")) == "yarn":
        compress_p = {"attention_factor": 1.0, **compress_p}
    main_p = {**main_p, "rope_type": "default"}  # sliding layers: plain RoPE whatever the config says
    make = lambda p: replace(rope_spec({"rope_parameters": p}, rope_dim, interleaved=True, dim=rope_dim), last=True)  # noqa: E731
    return make(main_p), make(compress_p)


def deepseek_v4_spec(raw: dict) -> ModelSpec:
    raw = {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
    kinds, rates, mlps = _schedule(raw)
    D = raw["head_dim"]
    partial = raw.get("partial_rotary_factor") or raw.get("qk_rope_head_dim", 64) / D
    main, compress = _ropes(raw, int(D * partial))
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"deepseek_v4: hidden_act {raw['hidden_act']!r} is not supported; supported: silu")
    if raw["scoring_func"] not in ("sqrtsoftplus", "sigmoid"):
        raise ValueError(f"deepseek_v4: scoring_func {raw['scoring_func']!r} is not supported; supported: sqrtsoftplus, sigmoid")

    base = CompressedAttnSpec(raw["num_attention_heads"], D, raw["q_lora_rank"], main, raw["sliding_window"],
                              raw["o_groups"], raw["o_lora_rank"], norm_eps=raw["rms_norm_eps"])
    indexer = IndexerSpec(raw["index_n_heads"], raw["index_head_dim"], raw["index_topk"], compress)
    attns = {
        SWA: base,
        CSA: replace(base, rope=compress, compress_ratio=rates[CSA], overlap=True, compress_rope=compress, indexer=indexer),
        HCA: replace(base, rope=compress, compress_ratio=rates[HCA], compress_rope=compress),
    }
    E, I, shared = raw["n_routed_experts"], raw["moe_intermediate_size"], raw["n_shared_experts"]
    limit = raw["swiglu_limit"]
    moe = MoESpec(E, raw["num_experts_per_tok"], I, router=raw["scoring_func"], correction_bias=True,
                  routed_scaling_factor=raw["routed_scaling_factor"], n_shared=shared, shared_intermediate_size=shared * I,
                  swiglu_limit=limit, shared_clamp=True, expert_format=_expert_format(raw))
    mlp = {"moe": moe, "hash_moe": replace(moe, hash_routing=True, correction_bias=False)}
    layers = (LayerSpec(i, attns[kinds[i]], mlp[mlps[i]]) for i in range(raw["num_hidden_layers"]))
    hyper = HyperSpec(raw["hc_mult"], raw["hc_eps"], 2.0, post_eps=False, sinkhorn_iters=raw["hc_sinkhorn_iters"])
    spec = model_spec(raw, layers)
    # the release keeps the compressors' projections in BF16 (no scales), whatever modules_to_not_convert says
    return replace(spec, hyper=hyper, linear_exclude=(*spec.linear_exclude, *KEEP_BF16))


# linears the release stores in BF16 inside an FP8 checkpoint (the indexer's weights_proj is KEEP_HIGH anyway)
KEEP_BF16 = ("compressor.kv_proj", "compressor.gate_proj")


def _expert_format(raw: dict) -> str:
    """Routed experts: packed FP4 with UE8M0 scales per 32 values (the release: ``expert_dtype: fp4``, kept as
    MXFP4), block FP8 like the other linears, or dense."""
    linears = weight_format(raw)[0]
    fp4 = (raw.get("quantization_config") or {}).get("expert_dtype", raw.get("expert_dtype")) == "fp4"
    return "mxfp4" if linears == "fp8_block" and fp4 else linears


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


register(Adapter(
    "deepseek_v4", deepseek_v4_spec, deepseek_v4_rules, ignore=(r"(?:model\.)?mtp\..*",),
    notes="sliding-window MQA + compressed (HCA) and indexed compressed (CSA) entries + sqrt-softplus / hash MoE + mHC",
))
