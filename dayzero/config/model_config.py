"""Model configuration: the native ``dayzero_hybrid`` config and the per-layer spec the model is built from.

A ``config.json`` with ``"model_type": "dayzero_hybrid"`` describes a decoder whose layers each pick an
attention kind (``kda``, ``dsa``, ``gqa``) and an MLP kind (``dense`` or ``moe``). The per-layer kinds are
fixed here, at load time, so the forward pass never branches on types per step.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from dayzero.config.spec import (
    GQASpec, IndexerSpec, KDASpec, LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec, RopeScaling, RopeSpec, softmax_scale,
)

ATTN_KINDS = ("kda", "dsa", "gqa")
MLP_KINDS = ("dense", "moe")
ROUTER_KINDS = ("sigmoid", "softmax")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HybridConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # attention kind per layer
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # dense GQA
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int = 64
    sliding_window: int | None = None
    # MLA / DSA (MLA heads = num_attention_heads)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    attn_output_gate: bool = True  # sigmoid output gate on DSA layers ("gated DSA")
    # KDA
    kda_num_heads: int = 8
    kda_head_dim: int = 64
    kda_conv_size: int = 4
    kda_gate_lower_bound: float | None = None
    # MLP / MoE
    intermediate_size: int = 1024  # dense MLP width
    first_k_dense_replace: int = 0
    n_routed_experts: int = 0  # 0 = every layer dense
    num_experts_per_tok: int = 1
    n_shared_experts: int = 0
    moe_intermediate_size: int = 256
    router: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    moe_latent_size: int | None = None  # LatentMoE: experts run at this width
    moe_latent_norm: bool = False
    model_type: str = "dayzero_hybrid"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        err = []
        if len(self.layer_types) != self.num_hidden_layers:
            err.append(f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is {self.num_hidden_layers}")
        bad = sorted({k for k in self.layer_types if k not in ATTN_KINDS})
        if bad:
            err.append(f"layer_types has unknown kinds {bad}; supported: {list(ATTN_KINDS)}")
        if self.router not in ROUTER_KINDS:
            err.append(f"router must be one of {list(ROUTER_KINDS)}, got {self.router!r}")
        if self.torch_dtype not in DTYPES:
            err.append(f"torch_dtype must be one of {list(DTYPES)}, got {self.torch_dtype!r}")
        if "gqa" in self.layer_types and self.num_attention_heads % self.num_key_value_heads:
            err.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.n_routed_experts:
            if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
                err.append("num_experts_per_tok must be in [1, n_routed_experts]")
            if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
                err.append("n_routed_experts must divide into n_group groups and topk_group <= n_group")
        if err:
            raise ValueError("invalid dayzero_hybrid config: " + "; ".join(err))

    # --- derived structure -------------------------------------------------------------
    def mlp_kind(self, i: int) -> str:
        return "moe" if self.n_routed_experts and i >= self.first_k_dense_replace else "dense"

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.torch_dtype]

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eos_ids(self) -> tuple[int, ...]:
        e = self.eos_token_id
        return () if e is None else (tuple(e) if isinstance(e, (list, tuple)) else (e,))

    @property
    def expert_format(self) -> str:
        method = (self.extra.get("quantization_config") or {}).get("quant_method")
        if method not in (None, "mxfp4"):
            raise ValueError(f"quantization method {method!r} is not supported for dayzero_hybrid; supported: mxfp4")
        return "mxfp4" if method == "mxfp4" else "dense"

    def to_spec(self) -> ModelSpec:
        scaling = self.rope_scaling if self.rope_scaling is not None and self.rope_scaling.factor > 1 else None
        layers = []
        for i, kind in enumerate(self.layer_types):
            if kind == "kda":
                attn = KDASpec(self.kda_num_heads, self.kda_head_dim, self.kda_conv_size, self.kda_gate_lower_bound)
            elif kind == "dsa":
                attn = MLASpec(
                    self.num_attention_heads, self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim,
                    self.qk_rope_head_dim, self.v_head_dim,
                    rope=RopeSpec(self.qk_rope_head_dim, self.rope_theta, scaling, interleaved=True),
                    scale=softmax_scale(self.qk_head_dim, scaling),
                    indexer=IndexerSpec(self.index_n_heads, self.index_head_dim, self.index_topk,
                                        RopeSpec(self.qk_rope_head_dim, self.rope_theta, scaling)),
                    output_gate=self.attn_output_gate,
                )
            else:
                attn = GQASpec(self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                               RopeSpec(self.head_dim, self.rope_theta, scaling), sliding_window=self.sliding_window)
            if self.mlp_kind(i) == "moe":
                mlp = MoESpec(
                    self.n_routed_experts, self.num_experts_per_tok, self.moe_intermediate_size, router=self.router,
                    correction_bias=self.router == "sigmoid", n_group=self.n_group, topk_group=self.topk_group,
                    norm_topk_prob=self.norm_topk_prob, routed_scaling_factor=self.routed_scaling_factor,
                    activation=self.extra.get("moe_activation", "silu"), n_shared=self.n_shared_experts,
                    shared_intermediate_size=self.n_shared_experts * self.moe_intermediate_size,
                    latent_size=self.moe_latent_size, latent_norm=self.moe_latent_norm,
                    expert_format=self.expert_format,
                )
            else:
                mlp = MLPSpec(self.intermediate_size)
            layers.append(LayerSpec(i, attn, mlp))
        return ModelSpec(
            self.model_type, self.vocab_size, self.hidden_size, tuple(layers), self.max_position_embeddings,
            self.rms_norm_eps, tie_word_embeddings=self.tie_word_embeddings, torch_dtype=self.torch_dtype,
            eos_token_id=self.eos_ids, bos_token_id=self.bos_token_id,
        )

    # --- (de)serialisation --------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "HybridConfig":
        d = dict(d)
        if d.get("model_type", "dayzero_hybrid") != "dayzero_hybrid":
            raise ValueError(f"model_type {d['model_type']!r} is not dayzero_hybrid")
        n = d.get("num_hidden_layers")
        if "layer_types" not in d:
            pattern = d.pop("layer_pattern", None)
            if pattern is None or n is None:
                raise ValueError("config needs layer_types (one attention kind per layer) or layer_pattern")
            d["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
        else:
            d.pop("layer_pattern", None)
        d["layer_types"] = tuple(d["layer_types"])
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        if "dtype" in d and "torch_dtype" not in d:  # transformers 5 spelling
            d["torch_dtype"] = d.pop("dtype")
        rs = d.get("rope_scaling")
        if rs:
            rs = dict(rs)
            kind = rs.pop("type", rs.pop("rope_type", "yarn"))
            if kind != "yarn":
                raise ValueError(f"rope_scaling type {kind!r} is not supported; supported: ['yarn']")
            d["rope_scaling"] = RopeScaling(**rs)
        else:
            d["rope_scaling"] = None
        known = {f.name for f in fields(cls)}
        extra = {k: v for k, v in d.items() if k not in known}
        d = {k: v for k, v in d.items() if k in known}
        d["extra"] = extra
        return cls(**d)

    @classmethod
    def from_file(cls, path: str | Path) -> "HybridConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            v = getattr(self, f.name)
            if isinstance(v, RopeScaling):
                v = {"type": "yarn", **v.__dict__}
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        out.update(self.extra)
        return out
