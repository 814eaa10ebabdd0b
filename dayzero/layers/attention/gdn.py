"""Gated DeltaNet (Qwen3-Next linear attention): KDA with one scalar decay per head and token.

Per value head, with state S in R^{K x V}:  S_t = (I - b_t k_t k_t^T) e^{g_t} S_{t-1} + b_t k_t v_t^T,
o_t = S_t^T q_t, where g_t = -exp(A_log) softplus(a_t + dt_bias) is a scalar. That is the KDA recurrence
with g broadcast over K, so the KDA ops (``kda_gate``, ``causal_conv1d``, ``kda_chunk``/``kda_recurrent``)
run it unchanged. Differences from KDA:

- q, k, v come from one projection with z (the output gate), and b (beta logit) and a (decay input)
  from another; one short conv runs over the concatenated q, k, v channels;
- ``num_k_heads`` may be smaller than ``num_v_heads``: each q/k head serves ``num_v_heads/num_k_heads``
  consecutive value heads (grouped like GQA), and the state is [Hv, K, V];
- the output norm is a per-head RMSNorm (plain weight, not zero-centred) gated by SiLU(z), not sigmoid.

Our parameters hold q, k, v, z (and b, a) as contiguous blocks, head-major; Qwen3-Next checkpoints group
them per key head and :func:`ungroup_qkvz` / :func:`ungroup_ba` reorder them at load.

Under tensor parallelism a rank holds Hk/tp key heads and the Hv/tp value heads they serve (the grouping stays
within a rank): its heads' rows of q, k, v, z, b and a and of the conv, ``A_log`` and ``dt_bias``; the output
norm (per value head) is whole, ``out_proj`` row-parallel (one all-reduce of [T, D] per layer), and the state
slots hold the rank's heads ([Hv/tp, K, V] and the conv windows of its channels). q, k and v, z have unequal
widths: ``in_proj_qkvz`` and the conv declare them (:func:`~dayzero.layers.parallel.cut_by_blocks`) and the
loader reads the rank's rows of each; [b | a] is cut as two equal parts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dayzero import ops
from dayzero.cache.spec import StateSpec
from dayzero.config.spec import GDNSpec  # noqa: F401  (re-exported for adapters)
from dayzero.distributed import SINGLE, ParallelState, divide
from dayzero.layers.attention.kda import DeltaRuleLayer
from dayzero.layers.fused import fuse, project
from dayzero.layers.norm import RMSNorm
from dayzero.loader.rules import per_group
from dayzero.layers.parallel import Linear, Shard, column_linear, cut_by_blocks, row_linear


def ungroup_qkvz(spec: GDNSpec):
    """Checkpoint [Hk * (2K + 2rV), D], per key head [q(K) | k(K) | v(rV) | z(rV)] (r = Hv/Hk), to our
    [q (Hk K) | k (Hk K) | v (Hv V) | z (Hv V)]; a tensor-parallel rank reads only its key heads' groups."""
    return _ungroup(spec, (spec.head_k_dim, spec.head_k_dim, _rV(spec), _rV(spec)))


def ungroup_ba(spec: GDNSpec):
    """Checkpoint [2 Hv, D], per key head [b(r) | a(r)], to our [b (Hv) | a (Hv)]; likewise per rank."""
    r = spec.num_v_heads // spec.num_k_heads
    return _ungroup(spec, (r, r))


def _rV(spec: GDNSpec) -> int:
    return spec.num_v_heads // spec.num_k_heads * spec.head_v_dim


def _ungroup(spec: GDNSpec, widths: tuple[int, ...]):
    """Rows grouped per key head as ``widths`` parts to each part's rows of every head, part after part."""
    def transform_of(heads: int):
        def transform(t: torch.Tensor) -> torch.Tensor:
            parts = t.reshape(heads, sum(widths), -1).split(list(widths), dim=1)
            return torch.cat([p.reshape(-1, t.shape[-1]) for p in parts])

        return transform

    return per_group(spec.num_k_heads, sum(widths), transform_of)


class GatedDeltaNet(DeltaRuleLayer):
    in_proj_members = ["in_proj_qkvz", "in_proj_ba"]  # one GEMM once fused (dayzero.layers.fused)
    takes_projected = True  # forward may be given fused_in(x), computed with the input norm

    def __init__(self, hidden: int, spec: GDNSpec, eps: float = 1e-6, parallel: ParallelState = SINGLE):
        super().__init__()
        if spec.num_v_heads % spec.num_k_heads:
            raise ValueError(f"num_v_heads {spec.num_v_heads} is not a multiple of num_k_heads {spec.num_k_heads}")
        self.spec, self.eps, self.parallel = spec, eps, parallel
        K, V, W = spec.head_k_dim, spec.head_v_dim, spec.conv_size
        heads = "the Gated DeltaNet layers' num_k_heads"
        # the rank's key heads and the value heads they serve
        self.Hk, self.Hv = divide(spec.num_k_heads, parallel, heads), spec.num_v_heads // parallel.tp_size
        self.K, self.V = K, V
        self.conv_dim = 2 * self.Hk * K + self.Hv * V  # the rank's [q | k | v] channels
        # [q | k | v | z] widths of all heads: both projections below are built whole (see the module docstring)
        blocks = (spec.num_k_heads * K, spec.num_k_heads * K, spec.num_v_heads * V, spec.num_v_heads * V)
        C = self.conv_dim
        self.in_proj_qkvz = Linear(hidden, C + self.Hv * V, bias=False)  # the rank's [q | k | v | z]
        self.in_proj_ba = column_linear(hidden, 2 * spec.num_v_heads, False, parallel, what=heads, parts=2)  # [b | a]
        self.conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)  # weight [C, 1, W]
        for module, parts in ((self.in_proj_qkvz, blocks), (self.conv1d, blocks[:3])):
            cut = cut_by_blocks(parts, parallel, heads)
            if cut is not None:
                module.shards = {"weight": cut}
        self.A_log = nn.Parameter(torch.zeros(self.Hv, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(self.Hv, dtype=torch.float32))
        self.norm = RMSNorm(V, eps)
        self.out_proj = row_linear(spec.num_v_heads * V, hidden, False, parallel, what=heads)
        if parallel.tp_size > 1:  # one per value head
            cut = Shard(0, parallel.tp_rank, parallel.tp_size)
            self.shards = {"A_log": cut, "dt_bias": cut}

    def cache_spec(self, dtype):
        # the recurrent state is fp32 whatever the model dtype: it accumulates over the whole sequence
        return StateSpec({"state": ((self.Hv, self.K, self.V), torch.float32),
                          "conv": ((self.conv_dim, self.spec.conv_size - 1), dtype)})

    def process_weights_after_loading(self) -> None:
        fuse(self, "fused_in", self.in_proj_members)

    def forward(self, x: torch.Tensor, batch, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``projected``: ``fused_in(x)`` when the caller computed it (with the input norm, DecoderLayer._mix)."""
        T, Hk, Hv, K, V = x.shape[0], self.Hk, self.Hv, self.K, self.V
        qkvz, ba = project(self, "fused_in", self.in_proj_members, x, projected)
        qkv, z = qkvz.split([self.conv_dim, Hv * V], dim=-1)
        q, k, v = self.conv("conv", qkv, self.conv1d.weight, batch).split([Hk * K, Hk * K, Hv * V], dim=-1)
        r = Hv // Hk
        q = q.reshape(T, Hk, K).repeat_interleave(r, dim=1)  # [T, Hv, K]: key head h serves value heads h*r..
        k = k.reshape(T, Hk, K).repeat_interleave(r, dim=1)
        b, a = ba.split([Hv, Hv], dim=-1)
        g = ops.call("kda_gate", a.reshape(T, Hv, 1), self.A_log, self.dt_bias).expand(T, Hv, K)  # fp32, <= 0
        beta = torch.sigmoid(b.float())  # [T, Hv]
        o = self.delta_rule(q, k, v.reshape(T, Hv, V), g, beta, K**-0.5, batch)  # [T, Hv, V]

        o = self.norm(o).float() * F.silu(z.reshape(T, Hv, V).float())  # gated norm, gate after the norm
        return self.out_proj(o.to(x.dtype).reshape(T, Hv * V))
