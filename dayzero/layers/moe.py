"""Mixture-of-Experts block: router, routed experts (stacked weights), shared experts, LatentMoE.

Experts are stored stacked (``w1`` [E, 2I, L], ``w2`` [E, L, I]) so the expert computation is one GEMM
per expert over the tokens routed to it, and so expert parallelism and quantised (MXFP4) storage can
later replace the tensors without touching the model. With ``latent_size`` set (LatentMoE, ARCHITECTURE.md
3.3) routing still reads the full-width x, but the routed experts run at width L between a shared
down-projection ``fc1_latent_proj`` [L, D] and up-projection ``fc2_latent_proj`` [D, L]; an optional
RMSNorm on the experts' latent output (the Kimi K3 variant) sits before the up-projection.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.config.model_config import HybridConfig
from dayzero.layers.mlp import MLP
from dayzero.layers.norm import RMSNorm


class MoE(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        D, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
        L = cfg.moe_latent_size or D
        self.cfg = cfg
        self.activation = cfg.extra.get("moe_activation", "silu")
        gate_rows = 2 * I if self.activation == "silu" else I
        # The router stays in fp32: selection is sensitive to rounding (ARCHITECTURE.md 3.1).
        self.gate = nn.Linear(D, E, bias=False, dtype=torch.float32)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(E, dtype=torch.float32)) if cfg.router == "sigmoid" else None
        )
        self.w1 = nn.Parameter(torch.empty(E, gate_rows, L))  # [E, 2I, L]: gate rows then up rows
        self.w2 = nn.Parameter(torch.empty(E, L, I))  # [E, L, I]
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(D, L, bias=False)
            self.fc2_latent_proj = nn.Linear(L, D, bias=False)
            self.latent_norm = RMSNorm(L, cfg.rms_norm_eps) if cfg.moe_latent_norm else None
        self.shared_experts = MLP(D, cfg.n_shared_experts * I, self.activation) if cfg.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        cfg = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [T, E] fp32
        weights, ids = ops.call(
            "moe_route", logits, cfg.num_experts_per_tok, cfg.router, self.e_score_correction_bias,
            cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, 1.0,
        )
        h = self.fc1_latent_proj(x) if self.latent else x  # [T, L]
        y = ops.call("moe_experts", h, ids, weights, self.w1, self.w2, self.activation)
        if self.latent:
            if self.latent_norm is not None:
                y = self.latent_norm(y)
            y = self.fc2_latent_proj(y)
        # The routed scale is applied to the routed output (it commutes with the bias-free fc2, and must
        # come after the optional latent norm, which would otherwise cancel it).
        y = y * cfg.routed_scaling_factor
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
