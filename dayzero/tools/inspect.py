"""``dayzero inspect MODEL``: the structural health check of a model, from ``config.json`` alone.

The model is built on the meta device (no memory, no weights), so a 2.8T-parameter model is inspected on
a laptop in seconds. Reported: layer kinds (run-length compressed), attention and MoE structure, parameter
counts by component (total and active per token), weights as stored and their bytes, and cache bytes per
token and per sequence. When MODEL is a checkpoint directory, every safetensors header (never the data) is
checked against the structure the config implies; any mismatch makes the exit status non-zero.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict

from dayzero.cache.planner import window_blocks
from dayzero.cache.spec import PagedSpec, StateSpec
from dayzero.config.spec import GQASpec, KDASpec, LayerSpec, MLASpec, ModelSpec, MoESpec, RopeSpec
from dayzero.tools import fmt
from dayzero.tools.model_info import (
    ModelInfo, block_size_of, cache_specs, count_params, declared_format, load, paged_bytes_per_token, stored_bytes,
)

CONTEXTS = (4096, 131072, 1048576)


# --- layer kinds ---------------------------------------------------------------------------------------
def layer_label(layer: LayerSpec, mixed_mlp: bool) -> str:
    a = layer.attn_kind
    if a is None:
        return {"moe": "MoE", "dense": "MLP"}.get(layer.mlp_kind, "empty")
    label = a.upper()
    if isinstance(layer.attn, GQASpec) and layer.attn.sliding_window:
        label = "SWA"
    if layer.mlp_kind == "dense" and mixed_mlp:
        label += "+dense"
    return label


def layer_labels(spec: ModelSpec) -> list[str]:
    kinds = {l.mlp_kind for l in spec.layers}
    mixed = "moe" in kinds and len(kinds) > 1
    return [layer_label(l, mixed) for l in spec.layers]


def compress(labels: list[str]) -> str:
    """'KDA+dense×1, KDA×2, DSA×1, then [KDA×3, DSA×1] repeated 15×': runs, then the shortest
    description as head + repeated body + tail."""
    runs: list[list] = []
    for lab in labels:
        if runs and runs[-1][0] == lab:
            runs[-1][1] += 1
        else:
            runs.append([lab, 1])
    runs = [tuple(r) for r in runs]
    show = lambda rs: ", ".join(f"{k}×{n}" for k, n in rs)  # noqa: E731
    best = (len(runs), show(runs))
    for h in range(len(runs)):
        for p in range(1, (len(runs) - h) // 2 + 1):
            body = runs[h:h + p]
            k = 1
            while runs[h + k * p:h + (k + 1) * p] == body:
                k += 1
            tail = runs[h + k * p:]
            if k < 2:
                continue
            cost = h + p + 2 * len(tail) + 1  # a clean repeat reads better than a tail
            if cost < best[0]:
                text = (show(runs[:h]) + ", then " if h else "") + f"[{show(body)}] repeated {k}×"
                best = (cost, text + (f", then {show(tail)}" if tail else ""))
    return best[1]


# --- structure descriptions ----------------------------------------------------------------------------
def _rope(r: RopeSpec | None) -> str:
    if r is None:
        return "no RoPE"
    s = f"RoPE dim {r.dim} θ={r.theta:g}"
    if r.scaling is not None:
        s += f" YaRN ×{r.scaling.factor:g} from {r.scaling.original_max_position_embeddings}"
    return s + (" interleaved" if r.interleaved else "")


def describe_attn(a) -> str:
    if isinstance(a, GQASpec):
        parts = [f"{a.num_heads} q heads, {a.num_kv_heads} kv heads × {a.head_dim}", _rope(a.rope)]
        if a.sliding_window:
            parts.append(f"sliding window {a.sliding_window}")
        if a.qk_norm:
            parts.append(f"q/k {a.qk_norm} norm")
        if a.sinks:
            parts.append("attention sinks")
        if a.output_gate:
            parts.append(f"output gate ({a.output_gate})")
        if a.qkv_bias or a.o_bias:
            parts.append("biases")
        return ", ".join(parts)
    if isinstance(a, MLASpec):
        parts = [f"{a.num_heads} heads, q_lora {a.q_lora_rank or 'none'}, kv_lora {a.kv_lora_rank}, "
                 f"qk {a.qk_nope_head_dim} nope + {a.qk_rope_head_dim} rope, v {a.v_head_dim}", _rope(a.rope)]
        ix = a.indexer
        if ix is not None:
            shared = getattr(ix, "shared", False)
            who = "shared (reuses an earlier layer's top-k)" if shared else f"{ix.n_heads} heads × {ix.head_dim}"
            parts.append(f"indexer {who}, top-{ix.topk}")
        if a.output_gate:
            parts.append("sigmoid output gate")
        return ", ".join(parts)
    if isinstance(a, KDASpec):
        parts = [f"{a.num_heads} heads × {a.head_dim}, short conv {a.conv_size}"]
        if a.gate_lower_bound is not None:
            parts.append(f"forget-gate lower bound {a.gate_lower_bound:g}")
        return ", ".join(parts)
    fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(a) if f.name not in ("kind",)}
    return ", ".join(f"{k} {v}" for k, v in fields.items() if not dataclasses.is_dataclass(v))


def describe_mlp(m) -> str:
    if isinstance(m, MoESpec):
        router = m.router + (" + correction bias" if m.correction_bias else "") + (" + bias" if m.router_bias else "")
        parts = [f"{m.n_experts} routed experts, top-{m.top_k}, expert width {m.intermediate_size} ({m.activation}"
                 f"{', biased' if m.expert_bias else ''})", f"router {router}"]
        if m.n_group > 1:
            parts.append(f"{m.n_group} groups, top-{m.topk_group} groups kept")
        if m.routed_scaling_factor != 1.0:
            parts.append(f"routed scale {m.routed_scaling_factor:g}")
        if m.n_shared:
            plural = "s" if m.n_shared > 1 else ""
            parts.append(f"{m.n_shared} shared expert{plural} (width {m.shared_intermediate_size}"
                         f"{', gated' if m.shared_gate else ''})")
        if m.latent_size:
            parts.append(f"LatentMoE width {m.latent_size}{' + latent norm' if m.latent_norm else ''}")
        return ", ".join(parts)
    if m is None:
        return "none"
    return f"dense, width {m.intermediate_size} ({m.activation})"


def _groups(layers, key) -> list[tuple[object, list[int]]]:
    out: dict = {}
    for l in layers:
        v = key(l)
        if v is not None:
            out.setdefault(v, []).append(l.index)
    return list(out.items())


def _asdict(x):
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else x


# --- caches ---------------------------------------------------------------------------------------------
def cache_report(info: ModelInfo, kv_cache_dtype: str = "auto", block_size: int | None = None) -> dict:
    dtype = info.spec.dtype
    block_size = block_size_of(info, block_size)
    by_kind: dict[str, dict] = defaultdict(lambda: {"layers": 0, "bytes_per_token": 0.0, "state_bytes_per_seq": 0})
    seen = set()
    for i, kind, s in cache_specs(info, dtype):  # a layer may declare paged rows and a state
        window = getattr(s, "window", None)
        k = by_kind[f"{kind}, window {window}" if window else kind]
        if window:  # a query reads the newest `window` keys: a sequence holds the blocks they lie in
            k["window_tokens"] = window_blocks(window, block_size) * block_size
        k["layers"] += i not in seen
        seen.add(i)
        if isinstance(s, PagedSpec):
            k["bytes_per_token"] += paged_bytes_per_token(s, kv_cache_dtype, block_size)
            k["rows"] = {n: list(shape) for n, (shape, _) in s.rows.items()}
        elif isinstance(s, StateSpec):
            k["state_bytes_per_seq"] += s.bytes_per_seq()
            k["state"] = {n: [list(shape), str(d).removeprefix("torch.")] for n, (shape, d) in s.tensors.items()}
    for k in by_kind.values():
        k["bytes_per_token_per_layer"] = k["bytes_per_token"] / k["layers"]
        k["state_bytes_per_seq_per_layer"] = k["state_bytes_per_seq"] / k["layers"]
    per_token = sum(k["bytes_per_token"] for k in by_kind.values())
    per_seq = sum(k["state_bytes_per_seq"] for k in by_kind.values())
    return {
        "dtype": str(dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype,
        "by_kind": dict(by_kind),
        "bytes_per_token": per_token,
        "state_bytes_per_sequence": per_seq,
        "per_sequence": {fmt.tokens(L): per_seq + sum(k["bytes_per_token"] * min(L, k.get("window_tokens", L))
                                                      for k in by_kind.values()) for L in CONTEXTS},
    }


# --- the report -----------------------------------------------------------------------------------------
def inspect(model: str | None = None, kv_cache_dtype: str = "auto", check: bool = True) -> dict:
    info = load(model)
    spec = info.spec
    counts = count_params(info)
    moe = [l.mlp for l in spec.layers if isinstance(l.mlp, MoESpec)]
    main_moe = max(moe, key=lambda m: (m.n_experts, m.top_k)) if moe else None
    report = {
        "model": info.name,
        "model_type": spec.model_type,
        "config": str(info.config_file),
        "checkpoint": str(info.checkpoint) if info.checkpoint else None,
        "num_layers": spec.num_hidden_layers,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "layer_kinds": [l.attn_kind or "none" for l in spec.layers],
        "mlp_kinds": [l.mlp_kind or "none" for l in spec.layers],
        "layer_pattern": compress(layer_labels(spec)),
        "attention": [
            {"kind": a.layer_kind if isinstance(a, MLASpec) else a.kind, "layers": idx, "summary": describe_attn(a),
             "spec": _asdict(a)}
            for a, idx in _groups(spec.layers, lambda l: l.attn)
        ],
        "mlp": [
            {"kind": "moe" if isinstance(m, MoESpec) else "dense", "layers": idx, "summary": describe_mlp(m),
             "spec": _asdict(m)}
            for m, idx in _groups(spec.layers, lambda l: l.mlp)
        ],
        "experts_routed": main_moe.n_experts if main_moe else 0,
        "experts_active": main_moe.top_k if main_moe else 0,
        "experts_shared": main_moe.n_shared if main_moe else 0,
        "moe_layers": len(moe),
        **{k: v for k, v in counts.items() if k != "by_component"},
        "params_by_component": counts["by_component"],
    }
    by_fmt = stored_bytes(info)
    report["weights"] = {
        "source": "config",
        "format": declared_format(spec),
        "by_format": {f: sum(c.values()) for f, c in by_fmt.items()},
        "bytes": sum(sum(c.values()) for c in by_fmt.values()),
        "by_component": by_fmt,
    }
    cache = cache_report(info, kv_cache_dtype)
    report["cache"] = cache
    report["cache_bytes_per_token"] = cache["bytes_per_token"]
    report["cache_state_bytes_per_sequence"] = cache["state_bytes_per_sequence"]
    report["checkpoint_check"] = None
    if info.checkpoint is not None and check:
        from dayzero.tools.checkpoint_check import check_checkpoint

        cc = check_checkpoint(info)
        report["checkpoint_check"] = cc
        report["weights"] = {
            "source": "safetensors headers",
            "format": ", ".join(sorted(cc["by_format"])),
            "by_format": {f: sum(c.values()) for f, c in cc["by_format"].items()},
            "bytes": cc["bytes"],
            "by_component": cc["by_format"],
        }
    report["ok"] = report["checkpoint_check"] is None or report["checkpoint_check"]["ok"]
    return report


def _short(layers: list[int]) -> str:
    parts = fmt.ranges(layers).split(", ")
    return ", ".join(parts) if len(parts) <= 6 else ", ".join(parts[:3] + ["...", parts[-1]])


def render(r: dict) -> str:
    out = [f"{r['model']}: {r['model_type']}, {r['num_layers']} layers, hidden {r['hidden_size']}, "
           f"vocab {r['vocab_size']}, context {r['max_position_embeddings']:,}"
           + (", tied embeddings" if r["tie_word_embeddings"] else "")]
    out.append(f"layers: {r['layer_pattern']}")
    out.append("attention:")
    for a in r["attention"]:
        out.append(f"  {a['kind'].upper():<5} ×{len(a['layers']):<3} layers {_short(a['layers'])}: {a['summary']}")
    out.append("mlp:")
    for m in r["mlp"]:
        out.append(f"  {'MoE' if m['kind'] == 'moe' else 'dense':<5} ×{len(m['layers']):<3} "
                   f"layers {_short(m['layers'])}: {m['summary']}")
    rows = [[c, fmt.count(v["total"]), fmt.count(v["active"])] for c, v in r["params_by_component"].items()]
    rows.append(["total", fmt.count(r["params_total"]), fmt.count(r["params_active"])])
    out.append(f"parameters (active = per token; {r['experts_active']} of {r['experts_routed']} routed experts):"
               if r["experts_routed"] else "parameters:")
    out.append(fmt.table(rows, ["component", "total", "active"]))
    out.append(f"  active without embeddings {fmt.count(r['params_active_excl_embeddings'])}, "
               f"without the input embedding {fmt.count(r['params_active_excl_input_embedding'])}")
    w = r["weights"]
    out.append(f"weights as stored ({w['source']}: {w['format']}): {fmt.size(w['bytes'])} on disk")
    out.append("  " + ", ".join(f"{f} {fmt.size(b)}" for f, b in sorted(w["by_format"].items(), key=lambda x: -x[1])))
    c = r["cache"]
    out.append(f"cache ({c['dtype']}):")
    rows = []
    for kind, k in c["by_kind"].items():
        name, _, window = kind.partition(", ")
        rows.append([name.upper() + (f", {window}" if window else ""), k["layers"],
                     fmt.size(k["bytes_per_token_per_layer"]) if k["bytes_per_token"] else "-",
                     fmt.size(k["bytes_per_token"]) if k["bytes_per_token"] else "-",
                     fmt.size(k["state_bytes_per_seq_per_layer"]) if k["state_bytes_per_seq"] else "-",
                     fmt.size(k["state_bytes_per_seq"]) if k["state_bytes_per_seq"] else "-"])
    out.append(fmt.table(rows, ["kind", "layers", "per token/layer", "per token", "per seq/layer", "per seq"]))
    out.append("  per sequence: " + ", ".join(f"{L} tokens {fmt.size(b)}" for L, b in c["per_sequence"].items())
               + (" (windowed layers: the blocks their window reads)" if any("window_tokens" in k for k in c["by_kind"].values()) else ""))
    cc = r["checkpoint_check"]
    if cc is not None:
        files = f"{cc['files']} file{'s' if cc['files'] != 1 else ''}"
        head = f"checkpoint: {cc['tensors']} tensors in {files}, {fmt.size(cc['bytes'])}, headers only:"
        if cc["ok"]:
            out.append(head + " every tensor matches config.json")
        else:
            out.append(head + f" {len(cc['mismatches'])} mismatch{'es' if len(cc['mismatches']) > 1 else ''}")
            rows = [[m["kind"], m["tensor"], m["file"], m["detail"]] for m in cc["mismatches"]]
            out.append(fmt.table(rows, ["problem", "tensor", "file", "detail"]))
    return "\n".join(out)


def main(args) -> int:
    r = inspect(args.model, args.kv_cache_dtype)
    print(json.dumps(r, indent=1, default=str) if args.json else render(r))
    return 0 if r["ok"] else 1
