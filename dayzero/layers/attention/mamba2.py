"""Mamba-2 mixer (the ``M`` layers of Nemotron-H); the scan math lives in ``ops/ssd``.

One projection gives ``[z (I) | xBC (I + 2·G·N) | dt (H)]``, I = H·P. ``xBC`` runs through a depthwise
causal conv (with bias) and SiLU, then splits into x [H, P] and the group-shared B, C [G, N]; the scan
(``ssd_*``) uses dt = softplus(dt + dt_bias) within ``dt_limit`` and A = -exp(A_log), adds the D skip,
and its output goes through RMSNorm(y · silu(z)) per group of I/G channels, then ``out_proj``.

State per sequence (one slot): the fp32 SSM state [H, P, N] and the conv window (the last
``conv_size - 1`` pre-activation xBC inputs). A sequence that starts this step (position 0) starts from
zero state, so slots need no clearing when they are reused. The pooled ops read and write the slots in place:
the recurrent form when every sequence brings one token, the chunk form otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dayzero import ops
from dayzero.cache.spec import StateSpec
from dayzero.config.spec import Mamba2Spec  # noqa: F401  (re-exported for adapters)
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.norm import RMSNorm


class Mamba2Mixer(CachedLayer):
    def __init__(self, hidden: int, spec: Mamba2Spec, eps: float = 1e-5):
        super().__init__()
        self.spec, self.eps = spec, eps
        H, P, N, G = spec.num_heads, spec.head_dim, spec.state_size, spec.n_groups
        self.I, self.conv_dim = H * P, H * P + 2 * G * N
        self.in_proj = nn.Linear(hidden, self.I + self.conv_dim + H, bias=spec.bias)  # [z | xBC | dt]
        # depthwise causal conv weights [conv_dim, 1, W], as checkpoints store them
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, spec.conv_size, groups=self.conv_dim, bias=spec.conv_bias)
        # per-head SSM parameters stay fp32: they set the decay exp(dt·A), which compounds over the sequence
        self.dt_bias = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.D = nn.Parameter(torch.ones(H, dtype=torch.float32))
        self.norm = RMSNorm(self.I, eps)  # only its weight: applied gated and per group by ``ssd_gated_norm``
        self.out_proj = nn.Linear(self.I, hidden, bias=spec.bias)

    def cache_spec(self, dtype):
        s = self.spec
        # the SSM state is fp32 whatever the model dtype: it accumulates over the whole sequence
        return StateSpec({"ssm": ((s.num_heads, s.head_dim, s.state_size), torch.float32),
                          "conv": ((self.conv_dim, s.conv_size - 1), dtype)})

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        H, P, N, G = s.num_heads, s.head_dim, s.state_size, s.n_groups
        z, xbc, dt = self.in_proj(x).split([self.I, self.conv_dim, H], dim=-1)  # [T, I], [T, I + 2GN], [T, H]

        xbc = ops.call("causal_conv1d_pooled", xbc, self.conv1d.weight, self.cache["conv"], batch, None)
        h = xbc.float() if self.conv1d.bias is None else xbc.float() + self.conv1d.bias.float()
        xs, B, C = F.silu(h).to(x.dtype).split([self.I, G * N, G * N], dim=-1)

        dt = ops.call("ssd_dt", dt, self.dt_bias, s.dt_limit)  # [T, H] fp32
        A = -self.A_log.float().exp()  # [H], < 0
        y = ops.call("ssd_pooled", xs.view(T, H, P), dt, A, B.view(T, G, N), C.view(T, G, N), self.D, self.cache["ssm"],
                     batch, s.chunk_size)  # states updated in the pool

        y = ops.call("ssd_gated_norm", y.reshape(T, self.I), self.norm.weight, z, self.I // G, self.eps)
        return self.out_proj(y)

