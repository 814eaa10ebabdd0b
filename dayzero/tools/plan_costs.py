"""Per-layer costs the planner works from, read off the meta-device model: weight bytes by how they shard,
parameters a token touches, cache rows and state tensors with their sharding, and attention FLOPs.

Sharding conventions (docs/planning.md): attention, dense-MLP, shared-expert and latent-projection matrices
split over the tensor-parallel group; norms, router and other 1-D parameters are replicated; routed
experts spread over every device of a pipeline stage (expert parallel × expert tensor parallel). A cache
row or state tensor of rank >= 2 splits along its first (head) dimension over ``min(tp, that dim)``
ranks; a rank-1 row (the MLA latent, the indexer key: one row shared by all heads) is replicated.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dayzero.cache.spec import PagedSpec, StateSpec
from dayzero.config.spec import CompressedAttnSpec, GQASpec, KDASpec, MLASpec, MoESpec
from dayzero.multimodal.costs import cache_bytes, call_bytes, max_image_rows
from dayzero.multimodal.families import read_preprocessor_config, vision_family
from dayzero.tools.model_info import (
    EMBEDDING, LM_HEAD, ROUTED, ROUTER, VISION, ModelInfo, Param, cache_specs, format_bytes, paged_bytes_per_token,
)

# the conversion workspace's name -> the storage format its bytes are counted in: the FP8 workspace holds E2M1
# values with their E8M0 block scales widened (a scale per 32), the FP8 tiles one fp32 scale per 128 x 128
WORKSPACE_FORMATS = {"fp8": "fp8_ws", "fp8_tile": "fp8"}


@dataclass
class Row:
    """One paged cache row of a layer: bytes per token, the shard count it allows, how many keys a query reads."""

    name: str
    bytes_per_token: float
    max_shards: int  # 1: replicated over tensor parallel ranks
    read: str = "all"  # "all" | "topk" | "window"
    stride: int = 1  # tokens per row (compressed entries)


@dataclass
class LayerCost:
    index: int
    kind: str
    tp_bytes: float = 0.0  # weights split over tp
    rep_bytes: float = 0.0  # weights replicated on every rank
    expert_bytes: float = 0.0  # routed experts, all of them, as stored
    expert_ws_bytes: float = 0.0  # routed experts in the conversion workspace's format
    tp_params: float = 0.0
    rep_params: float = 0.0
    expert_params: float = 0.0
    n_experts: int = 0
    top_k: int = 0
    moe_width: int = 0  # width of the vectors dispatched to experts (latent width for LatentMoE)
    expert_rows: int = 0  # intermediate rows one expert computes per token (2I gated, I otherwise)
    expert_inter: int = 0  # I, split by expert tensor parallelism
    max_width: int = 0  # widest projection output (activation scratch)
    rows: list[Row] = field(default_factory=list)
    state: list[tuple[float, int]] = field(default_factory=list)  # (bytes per sequence, max shards)
    topk: int | None = None
    window: int | None = None
    attn: object = None
    indexer: object = None

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0


@dataclass
class ModelCosts:
    layers: list[LayerCost]
    embed_bytes: float
    head_bytes: float
    head_params: float
    other_bytes: float  # final norm and anything outside the layers
    tied: bool  # one tensor is both embedding and LM head
    hidden: int
    vocab: int
    max_position: int
    heads: list[int]  # attention head counts (tensor parallel must divide them)
    vision_bytes: float = 0.0  # the vision tower's weights (every rank holds it whole)
    encoder_call_bytes: float = 0.0  # one tower call of the largest image (dayzero.multimodal.costs)
    encoder_row_bytes: float = 0.0  # one feature row the encoder cache keeps


def _heads(attn) -> int | None:
    return getattr(attn, "num_heads", None)


def expert_format(info: ModelInfo) -> str:
    """The routed experts' format as the model holds them: "mxfp4" (packed), "fp8", or the float dtype."""
    kinds = {(p.kind, p.dtype) for p in info.params if p.component == ROUTED and not p.is_bias}
    if any(k == "mxfp4" for k, _ in kinds):
        return "mxfp4"
    if any(d == torch.float8_e4m3fn for _, d in kinds):
        return "fp8"
    dense = next((d for k, d in kinds if k == "weight"), None)
    return {torch.float32: "fp32", torch.float16: "fp16"}.get(dense, "bf16")


def _bytes(p: Param, experts: str | None) -> float:
    """Stored bytes of a parameter; routed-expert weights in ``experts`` when that overrides the config."""
    if experts is None or p.component != ROUTED or p.is_bias:
        return p.nbytes
    if p.kind == "scale":
        return 0.0  # the override's own scales are in format_bytes
    return format_bytes(p.logical_shape, experts)


def model_costs(info: ModelInfo, experts: str | None = None, workspace: str | None = None,
                kv_cache_dtype: str = "auto", block_size: int = 16,
                cache_dtype: torch.dtype | None = None) -> ModelCosts:
    """``experts``: store routed experts in this format instead of the config's ("bf16", "fp8", "mxfp4");
    ``workspace``: the format MXFP4 experts are converted into before they run ("bf16", "fp8"), or None."""
    spec = info.spec
    layers = [LayerCost(l.index, l.attn_kind or "none", attn=l.attn) for l in spec.layers]
    embed = head = head_params = other = vision = 0.0
    for p in info.params:
        b = _bytes(p, experts)
        if p.layer is None:
            if p.component == VISION:
                vision += b
            elif p.component == EMBEDDING:
                embed += b
                if spec.tie_word_embeddings:
                    head, head_params = head + b, head_params + p.logical
            elif p.component == LM_HEAD:
                head, head_params = head + b, head_params + p.logical
            else:
                other += b
            continue
        lc = layers[p.layer]
        if p.component == ROUTED:
            lc.expert_bytes += b
            lc.expert_params += p.logical
            if workspace is not None and not p.is_bias and p.kind != "scale":
                lc.expert_ws_bytes += format_bytes(p.logical_shape, WORKSPACE_FORMATS.get(workspace, workspace))
        elif p.component == ROUTER or len(p.shape) < 2:
            lc.rep_bytes += b
            lc.rep_params += p.logical
        else:
            lc.tp_bytes += b
            lc.tp_params += p.logical
    for l, lc in zip(spec.layers, layers):
        if isinstance(l.mlp, MoESpec):
            m = l.mlp
            lc.n_experts, lc.top_k = m.n_experts, m.top_k
            lc.moe_width = m.latent_size or spec.hidden_size
            lc.expert_rows = m.intermediate_size * (1 if m.activation == "relu2" else 2)
            lc.expert_inter = m.intermediate_size
        a = l.attn
        if isinstance(a, MLASpec) and a.indexer is not None:
            lc.topk = a.indexer.topk
            lc.indexer = None if getattr(a.indexer, "shared", False) else a.indexer
        if isinstance(a, GQASpec):
            lc.window = a.sliding_window
        if isinstance(a, CompressedAttnSpec):
            lc.window, lc.indexer = a.sliding_window, a.indexer
            lc.topk = a.indexer.topk if a.indexer is not None else None
    for mod_index, layer in enumerate(info.model.model.layers):
        widths = [m.out_features for name, m in layer.named_modules()  # nn.Linear and its quantised stand-ins
                  if hasattr(m, "out_features") and ".experts" not in name and "gate" != name.rsplit(".", 1)[-1]]
        layers[mod_index].max_width = max(widths, default=spec.hidden_size)
    for i, _, s in cache_specs(info, cache_dtype or info.spec.dtype):
        lc = layers[i]
        if isinstance(s, PagedSpec):
            for name, (shape, dt) in s.rows.items():
                lc.rows.append(Row(name, paged_bytes_per_token(s.only(name), kv_cache_dtype, block_size),
                                   shape[0] if len(shape) >= 2 else 1, _read(lc, name), s.strides.get(name, 1)))
        elif isinstance(s, StateSpec):
            for name, (shape, dt) in s.tensors.items():
                lc.state.append((math.prod(shape) * dt.itemsize, shape[0] if len(shape) >= 2 else 1))
    heads = sorted({h for l in spec.layers if (h := _heads(l.attn)) is not None})
    costs = ModelCosts(layers, embed, head, head_params, other, spec.tie_word_embeddings, spec.hidden_size,
                       spec.vocab_size, spec.max_position_embeddings, heads, vision_bytes=vision)
    return _with_encoder(info, costs, (cache_dtype or spec.dtype).itemsize)


def _with_encoder(info: ModelInfo, costs: ModelCosts, act_bytes: int) -> ModelCosts:
    """The encoder's transient terms of a vision-language checkpoint (its processor config read if present)."""
    if info.tower is None:
        return costs
    family = vision_family(info.raw)
    folder = info.source if info.source.is_dir() else info.config_file.parent
    processor = family.processor(info.raw, read_preprocessor_config(folder))
    costs.encoder_call_bytes = call_bytes(info.tower, max_image_rows(processor), act_bytes)
    costs.encoder_row_bytes = cache_bytes(info.tower, 1, act_bytes)
    return costs


def _read(lc: LayerCost, row: str) -> str:
    """Which keys of a cache row a query reads: the indexer's top-k, a sliding window, or all of them."""
    if isinstance(lc.attn, CompressedAttnSpec):  # paged: the entries (top-k of them with an indexer), indexer keys
        return "topk" if row == "ckv" and lc.topk else "all"
    if lc.topk is not None and "index" not in row:
        return "topk"
    return "window" if lc.window else "all"


def attn_flops(lc: LayerCost, context: float, prefill: bool) -> float:
    """FLOPs of one query token against ``context`` keys in one layer (all heads), beyond its projections."""
    a = lc.attn
    if isinstance(a, GQASpec):
        keys = min(context, a.sliding_window) if a.sliding_window else context
        return 4 * a.num_heads * a.head_dim * keys
    if isinstance(a, MLASpec):
        keys = min(context, lc.topk) if lc.topk else context
        if prefill:  # naive form: q·k over nope+rope dims, p·v over v dims, per head
            f = 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * keys
        else:  # absorbed form: scores over the 576-wide latent row, values over its first 512
            f = 2 * a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim) * keys
        if lc.indexer is not None:
            f += 2 * lc.indexer.n_heads * lc.indexer.head_dim * context
        return f
    if isinstance(a, CompressedAttnSpec):  # window keys + entries (q·k and p·v on the 1 shared head), indexer
        entries = context / a.compress_ratio if a.compress_ratio else 0.0
        keys = min(context, a.sliding_window) + (min(entries, a.indexer.topk) if a.indexer else entries)
        f = 4 * a.num_heads * a.head_dim * keys
        return f + (2 * a.indexer.n_heads * a.indexer.head_dim * entries if a.indexer else 0.0)
    if isinstance(a, KDASpec):  # decay, k·S, rank-1 update and S·q on a [K, V] state per head
        return 8 * a.num_heads * a.head_dim * a.head_dim
    # any other mixer: about 4 FLOPs per fp32 element of a recurrent state, read, updated and read out
    return float(sum(b for b, _ in lc.state))
