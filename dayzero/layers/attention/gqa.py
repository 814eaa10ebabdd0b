"""Dense grouped-query attention over paged K/V caches.

Covers the dense-attention variants of the supported families: q/k/v biases (gpt-oss), per-head q/k
RMSNorm (Qwen3), partial NeoX RoPE, sliding windows and attention sinks (gpt-oss), and the Qwen3-Next
output gate, whose q_proj emits ``[q | gate]`` per head (ARCHITECTURE.md 2.3).

Under tensor parallelism a rank holds H/tp query heads (with their sinks) and the k/v heads they read: Hkv/tp
of them, or, when tp exceeds Hkv, the one head of its group of tp/Hkv ranks. q/k/v are column-parallel (a rank
fuses its own shards), o_proj row-parallel: one all-reduce of [T, D] per layer; the cache holds the rank's heads.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec
from dayzero.config.spec import GQASpec
from dayzero.distributed import SINGLE, ParallelState, divide
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.fused import fuse, project
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import Shard, column_linear, fused_product, row_linear
from dayzero.layers.rotary import RotaryEmbedding


class GQAAttention(CachedLayer):
    in_proj_members = ["q_proj", "k_proj", "v_proj"]  # one GEMM once fused (dayzero.layers.fused)
    takes_projected = True  # forward may be given fused_in(x), computed with the input norm

    def __init__(self, hidden: int, spec: GQASpec, eps: float = 1e-6, norm_offset: bool = False,
                 parallel: ParallelState = SINGLE):
        super().__init__()
        self.spec = spec
        H, Hkv, Dh, tp = spec.num_heads, spec.num_kv_heads, spec.head_dim, parallel.tp_size
        # the rank's heads: H and Hkv below are local counts
        self.H, self.Dh = divide(H, parallel, "num_attention_heads"), Dh
        kv_shard = None
        if tp > Hkv:  # fewer k/v heads than ranks: each group of tp/Hkv ranks keeps one copy of its head
            if tp % Hkv:
                raise ValueError(f"tp={tp} is neither a divisor nor a multiple of num_key_value_heads={Hkv}")
            kv_shard = Shard(0, parallel.tp_rank // (tp // Hkv), Hkv)
            self.Hkv = 1
        else:
            self.Hkv = divide(Hkv, parallel, "num_key_value_heads")
        gated = spec.output_gate == "q_interleaved"
        self.q_proj = column_linear(hidden, H * Dh * (2 if gated else 1), spec.qkv_bias, parallel,
                                    what="num_attention_heads")
        self.k_proj = column_linear(hidden, Hkv * Dh, spec.qkv_bias, parallel, shard=kv_shard, what="num_key_value_heads")
        self.v_proj = column_linear(hidden, Hkv * Dh, spec.qkv_bias, parallel, shard=kv_shard, what="num_key_value_heads")
        self.o_proj = row_linear(H * Dh, hidden, spec.o_bias, parallel, what="num_attention_heads")
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.Dh, eps, offset=norm_offset)
            self.k_norm = RMSNorm(self.Dh, eps, offset=norm_offset)
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32)) if spec.sinks else None
        if tp > 1 and self.sinks is not None:
            self.shards = {"sinks": Shard(0, parallel.tp_rank, tp)}  # one sink per query head
        self.rotary = RotaryEmbedding(spec.rope) if spec.rope is not None else None
        self.scale = spec.scale if spec.scale is not None else self.Dh**-0.5

    def cache_spec(self, dtype):
        row = ((self.Hkv, self.Dh), dtype)
        return PagedSpec({"k": row, "v": row}, roles={"k": "key", "v": "value"}, window=self.spec.sliding_window)

    def process_weights_after_loading(self) -> None:
        fuse(self, "fused_in", self.in_proj_members)

    def forward(self, x: torch.Tensor, batch, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``projected``: ``fused_in(x)`` when the caller computed it (with the input norm, DecoderLayer._mix)."""
        T, H, Dh = x.shape[0], self.H, self.Dh
        batch = batch.group(self.cache_group)
        q, k, v = project(self, "fused_in", self.in_proj_members, x, projected)
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
            y = fused_product(self.o_proj, lambda w, b: ops.call("sigmoid_gate_linear", out, gate, w, b))
            if y is not None:  # the gate inside the output projection
                return y
            out = ops.call("sigmoid_gate", out, gate)
        return self.o_proj(out.reshape(T, H * Dh))
