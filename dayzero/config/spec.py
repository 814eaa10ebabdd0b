"""The per-layer model spec every architecture is built from.

Native configs (``dayzero_hybrid``) and Hugging Face adapters both produce a :class:`ModelSpec`: one
:class:`LayerSpec` per layer, each naming an attention (or mixer) spec and an MLP spec. The layer library
builds modules from these specs alone, so a new architecture is an adapter that maps its config onto
them, plus a checkpoint name table.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeScaling:
    """YaRN parameters; None on a spec means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class RopeSpec:
    dim: int  # rotated dims (partial rotary rotates the first ``dim`` of a head)
    theta: float = 10000.0
    scaling: RopeScaling | None = None
    interleaved: bool = False  # complex pairs (x0,x1),(x2,x3).. instead of NeoX halves
    last: bool = False  # rotate the LAST ``dim`` channels of a head instead of the first (HY-V4 indexer, DeepSeek-V4)
    # multimodal RoPE (Qwen3-VL, Qwen3.5): frequencies per (t, h, w) position axis, interleaved (see layers.rotary);
    # a text token has three equal axes, so this matters only where the batch gives 3-axis positions
    mrope_section: tuple[int, ...] | None = None


@dataclass(frozen=True)
class GQASpec:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: RopeSpec | None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "rms": per-head RMSNorm on q and k before RoPE
    sliding_window: int | None = None
    sinks: bool = False  # per-head learned logit added to the softmax denominator
    output_gate: str | None = None  # "q_interleaved": q_proj emits [q | gate] per head, out *= sigmoid(gate)
    scale: float | None = None
    kind: str = "gqa"


@dataclass(frozen=True)
class IndexerSpec:
    n_heads: int
    head_dim: int
    topk: int
    rope: RopeSpec  # applied to the first ``rope.dim`` dims of q and k (NeoX, the fixed V3.2 layout), or the last
    q_from_latent: bool = True  # wq_b reads the normalised q latent (c_q), else x
    # IndexCache (GLM-MoE-DSA ``indexer_types: "shared"``): no indexer weights or key cache; the layer reuses
    # the top-k of the nearest earlier layer that runs its indexer in the same step
    shared: bool = False
    norm_eps: float = 1e-6  # k_norm (LayerNorm) eps


@dataclass(frozen=True)
class MLASpec:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeSpec | None
    scale: float
    bias: bool = False  # attention_bias on q_a / kv_a / o projections
    indexer: IndexerSpec | None = None  # set: DSA (sparse top-k attention)
    output_gate: bool = False  # sigmoid gate on the per-head output, from its own projection of x
    # "elementwise": g_proj [H*v_head_dim, D], one gate per output channel; "headwise": [H, D], one per head
    output_gate_kind: str = "elementwise"
    sinks: bool = False  # per-head learned logit added to the softmax denominator (HY-V4)
    latent_norm_eps: float | None = None  # eps of q_a / kv_a latent RMSNorms (None: the model's rms_norm_eps)
    kind: str = "mla"

    @property
    def layer_kind(self) -> str:
        return "dsa" if self.indexer is not None else "mla"


@dataclass(frozen=True)
class CompressedAttnSpec:
    """DeepSeek-V4 attention: shared-KV multi-query attention (one K=V head) over a sliding window of recent
    tokens plus, when ``compress_ratio`` is set, entries that each pool ``compress_ratio`` tokens (all causal
    ones for HCA; the indexer's top-k for CSA). ``layers/attention/compressed.py`` has the math."""

    num_heads: int
    head_dim: int  # of q and of the shared K=V head
    q_lora_rank: int
    rope: RopeSpec  # q/kv RoPE (interleaved, on the last dims); compressed layers use the compress RoPE here too
    sliding_window: int
    o_groups: int  # grouped output projection: heads in g groups, each projected to o_lora_rank
    o_lora_rank: int
    compress_ratio: int = 0  # 0: sliding window only; m: one compressed entry per m tokens
    overlap: bool = False  # CSA: entry w pools window w and window w-1 (width 2m, stride m)
    compress_rope: RopeSpec | None = None  # RoPE of the compressed entries (and the indexer)
    indexer: IndexerSpec | None = None  # CSA: attend to the top-k compressed entries only
    norm_eps: float = 1e-6
    kind: str = "compressed"

    @property
    def layer_kind(self) -> str:
        return "swa" if not self.compress_ratio else ("csa" if self.indexer is not None else "hca")


@dataclass(frozen=True)
class KDASpec:
    num_heads: int
    head_dim: int
    conv_size: int = 4
    gate_lower_bound: float | None = None
    kind: str = "kda"


@dataclass(frozen=True)
class GDNSpec:
    """Gated DeltaNet (Qwen3-Next): KDA with one scalar decay per head; ``layers/attention/gdn.py``."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_size: int = 4
    kind: str = "gdn"

    @property
    def conv_dim(self) -> int:  # channels of the short conv: [q | k | v]
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class Mamba2Spec:
    """Mamba-2 mixer (Nemotron-H); ``layers/attention/mamba2.py``."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_size: int = 4
    chunk_size: int = 128
    dt_limit: tuple[float, float] = (0.0, math.inf)  # clamp of the time step after softplus
    conv_bias: bool = True
    bias: bool = False  # in_proj / out_proj biases
    kind: str = "mamba2"


@dataclass(frozen=True)
class MLPSpec:
    intermediate_size: int
    activation: str = "silu"  # "silu" (gated), "relu2" (not gated)
    bias: bool = False
    swiglu_limit: float | None = None  # "silu": gate clamped to <= limit, up to [-limit, limit] (DeepSeek-V4)


@dataclass(frozen=True)
class MoESpec:
    n_experts: int
    top_k: int
    intermediate_size: int
    # "sigmoid" | "sqrtsoftplus" (sqrt(softplus(logit)), DeepSeek-V4) | "softmax" | "softmax_topk" (top-k on logits,
    # softmax over the chosen)
    router: str = "sigmoid"
    hash_routing: bool = False  # experts fixed per token id by the ``tid2eid`` table [vocab, top_k]; weights still scored
    correction_bias: bool = True
    router_bias: bool = False
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    activation: str = "silu"  # "silu" | "relu2" | "swiglu_oai"
    expert_bias: bool = False
    n_shared: int = 0
    shared_intermediate_size: int = 0
    shared_gate: bool = False  # shared expert output scaled by sigmoid(shared_expert_gate x)
    latent_size: int | None = None
    latent_norm: bool = False
    swiglu_limit: float | None = None  # routed experts: gate clamped to <= limit, up to [-limit, limit] (HY-V4)
    shared_clamp: bool = False  # the shared experts clamp at ``swiglu_limit`` too (DeepSeek-V4)
    expert_format: str = "dense"  # "dense" | "mxfp4" (packed, converted per layer) | "fp8_block" (128×128 tiles)


@dataclass(frozen=True)
class HyperSpec:
    """Hyper-connections (HY-V4, DeepSeek-V4): the residual stream is carried as ``streams`` parallel copies;
    around each sublayer, input-dependent sigmoid weights mix them into the sublayer input and spread its
    output back. With ``sinkhorn_iters`` (DeepSeek-V4's manifold-constrained mHC) the copies are also mixed
    with each other by a doubly-stochastic matrix instead of being carried over unchanged."""

    streams: int
    eps: float = 1e-6  # added to the pre weights (and the comb matrix); to the post weights too with post_eps
    post_magnitude: float = 2.0  # scale of the sigmoid weights that spread a sublayer's output
    post_eps: bool = True  # HY-V4 adds eps to the post weights, DeepSeek-V4 does not
    sinkhorn_iters: int = 0  # > 0: a learned [n, n] stream mixing, projected by this many Sinkhorn-Knopp steps


AttnSpec = GQASpec | MLASpec | KDASpec | GDNSpec | Mamba2Spec | CompressedAttnSpec
MlpSpec = MLPSpec | MoESpec


@dataclass(frozen=True)
class LayerSpec:
    index: int
    attn: AttnSpec | None
    mlp: MlpSpec | None

    @property
    def attn_kind(self) -> str | None:
        if self.attn is None:
            return None
        return getattr(self.attn, "layer_kind", self.attn.kind)

    @property
    def mlp_kind(self) -> str | None:
        return None if self.mlp is None else ("moe" if isinstance(self.mlp, MoESpec) else "dense")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    norm_offset: bool = False  # RMSNorm weights stored zero-centred: y = norm(x) * (1 + w)
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    linear_format: str = "dense"  # "dense" | "fp8_block" (DeepSeek 128×128 block-scaled FP8 linears)
    linear_exclude: tuple[str, ...] = ()  # module globs kept in high precision (modules_to_not_convert)
    hyper: HyperSpec | None = None  # set: hyper-connections instead of one residual stream (models/hyper.py)

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)

    @property
    def layer_types(self) -> tuple[str | None, ...]:
        return tuple(l.attn_kind for l in self.layers)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    @property
    def dtype(self) -> torch.dtype:
        from dayzero.config.model_config import DTYPES

        return DTYPES.get(self.torch_dtype, torch.bfloat16)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(head_dim: int, scaling: RopeScaling | None) -> float:
    """1/sqrt(d), times mscale² when YaRN sets ``mscale_all_dim`` (the HF convention, ARCHITECTURE.md 2.1)."""
    scale = head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale
