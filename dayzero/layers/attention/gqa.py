"""Dense grouped-query attention over paged K/V caches.

Covers the dense-attention variants of the supported families: q/k/v biases (gpt-oss), per-head q/k
RMSNorm (Qwen3), partial NeoX RoPE, sliding windows and attention sinks (gpt-oss), and the Qwen3-Next
output gate, whose q_proj emits ``[q | gate]`` per head (ARCHITECTURE.md 2.3).
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec
from dayzero.config.spec import GQASpec
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.fused import fuse, project
from dayzero.layers.norm import RMSNorm
from dayzero.layers.rotary import RotaryEmbedding


class GQAAttention(CachedLayer):
    in_proj_members = ["q_proj", "k_proj", "v_proj"]  # one GEMM once fused (dayzero.layers.fused)

    def __init__(self, hidden: int, spec: GQASpec, eps: float = 1e-6, norm_offset: bool = False):
        super().__init__()
        self.spec = spec
        self.H, self.Hkv, self.Dh = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_rows = self.H * self.Dh * (2 if spec.output_gate == "q_interleaved" else 1)
        self.q_proj = nn.Linear(hidden, q_rows, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.Hkv * self.Dh, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.Hkv * self.Dh, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.H * self.Dh, hidden, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.Dh, eps, offset=norm_offset)
            self.k_norm = RMSNorm(self.Dh, eps, offset=norm_offset)
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32)) if spec.sinks else None
        self.rotary = RotaryEmbedding(spec.rope) if spec.rope is not None else None
        self.scale = spec.scale if spec.scale is not None else self.Dh**-0.5

    def cache_spec(self, dtype):
        row = ((self.Hkv, self.Dh), dtype)
        return PagedSpec({"k": row, "v": row}, roles={"k": "key", "v": "value"})

    def process_weights_after_loading(self) -> None:
        fuse(self, "fused_in", self.in_proj_members)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T, H, Dh = x.shape[0], self.H, self.Dh
        q, k, v = project(self, "fused_in", self.in_proj_members, x)
        gate = None
        if self.spec.output_gate == "q_interleaved":
            q, gate = q.view(T, H, 2 * Dh).chunk(2, dim=-1)  # per head: [q | gate]
        q = q.reshape(T, H, Dh)
        k = k.view(T, self.Hkv, Dh)
        v = v.view(T, self.Hkv, Dh)
        if self.spec.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary is not None:
            cos, sin = self.rotary.step_cos_sin(batch)
            q, k = self.rotary(q, cos, sin), self.rotary(k, cos, sin)
        self.write_rows("k", batch.slot_mapping, k)
        self.write_rows("v", batch.slot_mapping, v)
        out = ops.call("paged_attention", q, self.cache["k"], self.cache["v"], batch, self.scale, self.sinks,
                       self.spec.sliding_window)  # [T, H, Dh]
        if gate is not None:
            out = ops.call("sigmoid_gate", out, gate)
        return self.o_proj(out.reshape(T, H * Dh))
