"""Mamba-2 mixer (the ``M`` layers of Nemotron-H); the scan math lives in ``ops/ssd``.

One projection gives ``[z (I) | xBC (I + 2·G·N) | dt (H)]``, I = H·P. ``xBC`` runs through a depthwise
causal conv (with bias) and SiLU, then splits into x [H, P] and the group-shared B, C [G, N]; the scan
(``ssd_*``) uses dt = softplus(dt + dt_bias) within ``dt_limit`` and A = -exp(A_log), adds the D skip,
and its output goes through RMSNorm(y · silu(z)) per group of I/G channels, then ``out_proj``.

State per sequence (one slot): the fp32 SSM state [H, P, N] and the conv window (the last
``conv_size - 1`` pre-activation xBC inputs). A sequence that starts this step (position 0) starts from
zero state, so slots need no clearing when they are reused. The pooled ops read and write the slots in place:
the recurrent form when every sequence brings one token, the chunk form otherwise.

Under tensor parallelism a rank holds G/tp groups and the H/tp heads that read them (heads of one group are
consecutive): its rows of z, x, B, C and dt, its conv channels, ``dt_bias``, ``A_log``, ``D`` and its groups of
the output norm's weight; ``out_proj`` is row-parallel (one all-reduce of [T, D] per layer) and the state slots
hold the rank's heads ([H/tp, P, N] and the conv windows of its channels). The output norm takes its mean
square per group, so a rank needs whole groups: tp must divide ``n_groups``. The parts of the input projection
and of the conv have unequal widths: they declare them (:func:`~dayzero.layers.parallel.cut_by_blocks`) and
the loader reads the rank's rows of each.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dayzero import ops
from dayzero.cache.spec import StateSpec
from dayzero.config.spec import Mamba2Spec  # noqa: F401  (re-exported for adapters)
from dayzero.distributed import SINGLE, ParallelState
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import Linear, Shard, cut_by_blocks, row_linear


class Mamba2Mixer(CachedLayer):
    def __init__(self, hidden: int, spec: Mamba2Spec, eps: float = 1e-5, parallel: ParallelState = SINGLE):
        super().__init__()
        self.spec, self.eps, self.parallel = spec, eps, parallel
        tp = parallel.tp_size
        if spec.n_groups % tp:
            raise ValueError(f"tp={tp} does not divide n_groups={spec.n_groups} of the Mamba-2 layers: a rank holds "
                             "whole groups (their B and C, and the output norm's mean square per group)")
        H, P, N, G = spec.num_heads, spec.head_dim, spec.state_size, spec.n_groups  # all of them
        self.H, self.G = H // tp, G // tp  # the rank's heads and groups
        self.I, self.conv_dim = self.H * P, self.H * P + 2 * self.G * N
        blocks = (H * P, H * P, G * N, G * N, H)  # [z | x | B | C | dt] widths of all heads and groups
        self.in_proj = Linear(hidden, self.I + self.conv_dim + self.H, bias=spec.bias)  # the rank's [z | xBC | dt]
        # depthwise causal conv weights [conv_dim, 1, W], as checkpoints store them
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, spec.conv_size, groups=self.conv_dim, bias=spec.conv_bias)
        for module, parts in ((self.in_proj, blocks), (self.conv1d, blocks[1:4])):
            cut = cut_by_blocks(parts, parallel, "the Mamba-2 layers")
            if cut is not None:
                module.shards = {"weight": cut} | ({"bias": cut} if module.bias is not None else {})
        # per-head SSM parameters stay fp32: they set the decay exp(dt·A), which compounds over the sequence
        self.dt_bias = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.D = nn.Parameter(torch.ones(self.H, dtype=torch.float32))
        self.norm = RMSNorm(self.I, eps)  # only its weight: applied gated and per group by ``ssd_gated_norm``
        self.out_proj = row_linear(H * P, hidden, spec.bias, parallel)
        if tp > 1:  # by head (the norm's weight by the channels of the rank's heads, whole groups)
            cut = Shard(0, parallel.tp_rank, tp)
            self.shards = {n: cut for n in ("dt_bias", "A_log", "D", "norm.weight")}

    def cache_spec(self, dtype):
        s = self.spec
        # the SSM state is fp32 whatever the model dtype: it accumulates over the whole sequence
        return StateSpec({"ssm": ((self.H, s.head_dim, s.state_size), torch.float32),
                          "conv": ((self.conv_dim, s.conv_size - 1), dtype)})

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        s, T = self.spec, x.shape[0]
        H, P, N, G = self.H, s.head_dim, s.state_size, self.G
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
