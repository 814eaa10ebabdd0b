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
Checkpoint names and the release's FP8 / FP4 formats: ``deepseek_v4_names.py``. Multi-token-prediction
tensors (``mtp.*``) are not loaded.
"""
from __future__ import annotations

from dataclasses import replace

from dayzero.config.spec import CompressedAttnSpec, HyperSpec, IndexerSpec, LayerSpec, ModelSpec, MoESpec
from dayzero.models.adapters.common import rope_spec, weight_format
from dayzero.models.adapters.deepseek import model_spec
from dayzero.models.adapters.deepseek_v4_names import deepseek_v4_rules
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


register(Adapter(
    "deepseek_v4", deepseek_v4_spec, deepseek_v4_rules, ignore=(r"(?:model\.)?mtp\..*",),
    notes="sliding-window MQA + compressed (HCA) and indexed compressed (CSA) entries + sqrt-softplus / hash MoE + mHC",
))
