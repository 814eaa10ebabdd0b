"""Gated DSA: MLA (ARCHITECTURE.md 2.1) + lightning indexer top-k (2.2) + sigmoid output gate (2.3).

Cache per token: the latent row ``[c (kv_lora_rank) ‖ k_pe (rope dim)]`` and the indexer key, both paged
under the sequence's one block table. Prefill chunks attend in the naive (MHA) form; single-token decode
in the absorbed (MQA) form, which reads only the latent rows. When the sequence is no longer than
``index_topk`` the indexer selects every causal key, so it is skipped (the result is dense causal MLA).
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec
from dayzero.config.model_config import HybridConfig
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.norm import LayerNorm, RMSNorm
from dayzero.layers.rotary import RotaryEmbedding, softmax_scale
from dayzero.ops.attention.reference import indices_to_mask


class Indexer(nn.Module):
    def __init__(self, cfg: HybridConfig, q_in: int):
        super().__init__()
        self.H, self.Dh, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = nn.Linear(q_in, self.H * self.Dh, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.Dh, bias=False)
        self.k_norm = LayerNorm(self.Dh, 1e-6)
        # weights_proj stays in high precision (ARCHITECTURE.md 2.2)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.H, bias=False, dtype=torch.float32)
        self.weight_scale = self.H**-0.5 * self.Dh**-0.5

    def _rope(self, x, rotary, cos, sin):
        # RoPE on the first rope_dim dims, NeoX style, not interleaved (the fixed V3.2 layout)
        pe, nope = x.split([self.rope_dim, self.Dh - self.rope_dim], dim=-1)
        return torch.cat((rotary(pe, cos, sin), nope), dim=-1)

    def project(self, x, c_q, rotary, cos, sin):
        T = x.shape[0]
        q = self._rope(self.wq_b(c_q).view(T, self.H, self.Dh), rotary, cos, sin)  # [T, Hi, Di]
        k = self._rope(self.k_norm(self.wk(x)).view(T, 1, self.Dh), rotary, cos, sin)[:, 0]  # [T, Di]
        w = torch.nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi]
        return q, k, w


class DSAAttention(CachedLayer):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        D, H = cfg.hidden_size, cfg.num_attention_heads
        self.H, self.N, self.P, self.V, self.R = H, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        eps = cfg.rms_norm_eps
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (self.N + self.P), bias=False)
        else:
            self.q_proj = nn.Linear(D, H * (self.N + self.P), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.R + self.P, bias=False)
        self.kv_a_layernorm = RMSNorm(self.R, eps)
        self.kv_b_proj = nn.Linear(self.R, H * (self.N + self.V), bias=False)
        self.o_proj = nn.Linear(H * self.V, D, bias=False)
        self.g_proj = nn.Linear(D, H * self.V, bias=False) if cfg.attn_output_gate else None
        self.indexer = Indexer(cfg, cfg.q_lora_rank or D)
        self.rotary = RotaryEmbedding(self.P, cfg.rope_theta, cfg.rope_scaling, interleaved=True)
        self.index_rotary = RotaryEmbedding(self.P, cfg.rope_theta, cfg.rope_scaling, interleaved=False)
        self.scale = softmax_scale(self.N + self.P, cfg.rope_scaling)

    def cache_spec(self, dtype):
        return PagedSpec({"latent": ((self.R + self.P,), dtype), "index_k": ((self.indexer.Dh,), dtype)})

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = self.rotary.cos_sin(batch.positions)
        c_q = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_a_proj") else x
        q = (self.q_b_proj(c_q) if hasattr(self, "q_b_proj") else self.q_proj(x)).view(T, self.H, self.N + self.P)
        q_nope, q_pe = q.split([self.N, self.P], dim=-1)
        q_pe = self.rotary(q_pe, cos, sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.R, self.P], dim=-1)
        k_pe = self.rotary(k_pe.view(T, 1, self.P), cos, sin)[:, 0]
        self.write_rows("latent", batch.slot_mapping, torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1))
        iq, ik, iw = self.indexer.project(x, c_q, self.index_rotary, cos, sin)
        self.write_rows("index_k", batch.slot_mapping, ik)

        out = q_nope.new_empty(T, self.H, self.V)
        for b in range(batch.num_seqs):
            rows, slots, S = batch.rows(b), batch.key_slots(b), batch.seq_lens[b]
            q_pos = batch.positions[rows]
            key_mask = None
            if S > self.indexer.topk:
                idx = ops.call("indexer_topk", iq[rows], iw[rows], self.read_rows("index_k", slots), q_pos, self.indexer.topk)
                key_mask = indices_to_mask(idx, S)  # [Tq, S]
            form = "mla_absorbed" if rows.stop - rows.start == 1 else "mla_naive"
            out[rows] = ops.call(
                form, q_nope[rows], q_pe[rows], self.read_rows("latent", slots), self.kv_b_proj.weight,
                self.V, q_pos, self.scale, key_mask, None,
            )
        if self.g_proj is not None:
            out = (out.float() * torch.sigmoid(self.g_proj(x).float().view(T, self.H, self.V))).to(out.dtype)
        return self.o_proj(out.reshape(T, self.H * self.V))
