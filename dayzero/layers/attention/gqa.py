"""Dense grouped-query attention with NeoX RoPE over paged K/V caches."""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec
from dayzero.config.model_config import HybridConfig
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.rotary import RotaryEmbedding


class GQAAttention(CachedLayer):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        D, self.H, self.Hkv, self.Dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(D, self.H * self.Dh, bias=False)
        self.k_proj = nn.Linear(D, self.Hkv * self.Dh, bias=False)
        self.v_proj = nn.Linear(D, self.Hkv * self.Dh, bias=False)
        self.o_proj = nn.Linear(self.H * self.Dh, D, bias=False)
        self.rotary = RotaryEmbedding(self.Dh, cfg.rope_theta, cfg.rope_scaling)
        self.scale = self.Dh**-0.5
        self.window = cfg.sliding_window

    def cache_spec(self, dtype):
        row = ((self.Hkv, self.Dh), dtype)
        return PagedSpec({"k": row, "v": row})

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = self.rotary.cos_sin(batch.positions)
        q = self.rotary(self.q_proj(x).view(T, self.H, self.Dh), cos, sin)  # [T, H, Dh]
        k = self.rotary(self.k_proj(x).view(T, self.Hkv, self.Dh), cos, sin)  # [T, Hkv, Dh]
        v = self.v_proj(x).view(T, self.Hkv, self.Dh)
        self.write_rows("k", batch.slot_mapping, k)
        self.write_rows("v", batch.slot_mapping, v)
        out = torch.empty_like(q)
        for b in range(batch.num_seqs):
            rows, slots = batch.rows(b), batch.key_slots(b)
            out[rows] = ops.call(
                "attention", q[rows], self.read_rows("k", slots), self.read_rows("v", slots),
                batch.positions[rows], self.scale, None, None, self.window,
            )
        return self.o_proj(out.view(T, -1))
