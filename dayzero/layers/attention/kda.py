"""KDA (Kimi Delta Attention), ARCHITECTURE.md section 1, and what every delta-rule mixer shares.

State per sequence (one slot): the fp32 recurrent state [H, K, V] and the short-conv windows (the last
``conv_size - 1`` pre-activation inputs). A sequence that starts this step (position 0) starts from zero
state, so slots need no clearing when they are reused. The ops (``kda_pooled``, ``causal_conv1d_pooled``)
read and write the pool in place by the batch's state slots: the recurrent form when every sequence brings
one token, the chunk form otherwise.

Under tensor parallelism a rank holds H/tp heads: q, k, v, beta's projection, the gates' up-projections, the
convs, ``A_log`` and ``dt_bias`` are cut by head, the gates' low-rank down-projections and the output norm are
whole, ``o_proj`` is row-parallel (one all-reduce of [T, D] per layer), and the state slots hold the rank's heads.

Checkpoint layouts (Kimi-Linear, as vLLM and transformers store it): ``A_log`` may be [1, 1, H, 1] and
loads into our [H] through the name table; the three convs are separate [P, 1, W] weights.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import StateSpec
from dayzero.config.spec import KDASpec
from dayzero.layers.attention.base import CachedLayer
from dayzero.distributed import SINGLE, ParallelState, divide
from dayzero.layers.fused import concat_as_views, fuse, local_gemm, project
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import Linear, Shard, column_linear, fused_product, row_linear
from dayzero.ops.kda.step import gate_ups
from dayzero.ops.static import mark_static


class DeltaRuleLayer(CachedLayer):
    """A mixer whose cache is one state slot per sequence: short causal convs plus a delta-rule state
    (KDA, Gated DeltaNet). Subclasses name their cache tensors; the recurrent state is ``"state"``."""

    def conv(self, name: str, u: torch.Tensor, weight: torch.Tensor, batch, groups: int = 1) -> torch.Tensor:
        """SiLU(causal depthwise conv) of ``u`` [T, C], continuing each sequence's window ``name`` (in place);
        with ``groups`` G, [G, T, C/G] (each group of channels contiguous). The same launch zeroes the fresh
        sequences' recurrent states (the delta rule after it is told so)."""
        return ops.call("causal_conv1d_pooled", u, weight, self.cache[name], batch, "silu", groups,
                        reset=self.cache["state"])

    def delta_rule(self, q, k, v, g, beta, scale: float, batch, gate: tuple | None = None) -> torch.Tensor:
        """The gated delta rule from each sequence's state; q, k, g: [T, H, K], v: [T, H, V], beta: [T, H].
        Returns o [T, H, V]; the new states are written to the state pool in place. With ``gate`` (A_log,
        dt_bias, lower bound), g and beta are the gate's input and beta's logits, activated by the op. Called
        after :meth:`conv`, which zeroed the fresh sequences' states."""
        return ops.call("kda_pooled", q, k, v, g, beta, scale, self.cache["state"], batch, True, gate=gate,
                        zeroed=True)


class KDAAttention(DeltaRuleLayer):
    # the projections of the layer's input, one GEMM once fused (dayzero.layers.fused)
    in_proj_members = ["q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj"]
    takes_projected = True  # forward may be given fused_in(x), computed with the input norm

    def __init__(self, hidden: int, spec: KDASpec, eps: float = 1e-6, parallel: ParallelState = SINGLE):
        super().__init__()
        heads = "the KDA layers' num_heads"
        D, self.H, self.K = hidden, divide(spec.num_heads, parallel, heads), spec.head_dim  # self.H: the rank's
        full = spec.num_heads * self.K  # q, k, v channels of all heads; self.P: the rank's
        P, W = self.H * self.K, spec.conv_size
        self.P, self.W = P, W
        self.lower_bound = spec.gate_lower_bound
        self.eps = eps
        self.q_proj = column_linear(D, full, False, parallel, what=heads)
        self.k_proj = column_linear(D, full, False, parallel, what=heads)
        self.v_proj = column_linear(D, full, False, parallel, what=heads)
        # depthwise causal conv weights [P, 1, W], as checkpoints store them
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj = Linear(D, self.K, bias=False)  # the low-rank gate inputs: whole on every rank
        self.f_b_proj = column_linear(self.K, full, False, parallel, what=heads)
        self.b_proj = column_linear(D, spec.num_heads, False, parallel, what=heads)
        self.A_log = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        self.g_a_proj = Linear(D, self.K, bias=False)
        self.g_b_proj = column_linear(self.K, full, False, parallel, what=heads)
        self.o_norm = RMSNorm(self.K, eps)  # per-head gated norm over V
        self.o_proj = row_linear(full, D, False, parallel, what=heads)
        if parallel.tp_size > 1:  # the rank's heads of the per-head and per-channel parameters
            cut = Shard(0, parallel.tp_rank, parallel.tp_size)
            self.shards = {n: cut for n in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log",
                                            "dt_bias")}

    def cache_spec(self, dtype):
        # the recurrent state is fp32 whatever the model dtype: it accumulates over the whole sequence; one window
        # for the q, k and v convs, [q | k | v] channels
        return StateSpec({"state": ((self.H, self.K, self.K), torch.float32), "conv": ((3 * self.P, self.W - 1), dtype)})

    def process_weights_after_loading(self) -> None:
        fuse(self, "fused_in", self.in_proj_members)
        # the three conv weights as views of one [3P, 1, W]: the q, k and v convs run as one call
        self._conv_weight = concat_as_views([self.q_conv1d, self.k_conv1d, self.v_conv1d], "weight")
        # the forget gate's and the output gate's up-projections as views of one [2, P, K]: one batched GEMM
        ups = [self.f_b_proj, self.g_b_proj]
        if all(local_gemm(m) and m.bias is None for m in ups) and ups[0].weight.dtype == ups[1].weight.dtype:
            self._gate_up_weight = mark_static(concat_as_views(ups, "weight").view(2, self.P, self.K))

    def conv_weight(self) -> torch.Tensor:
        """The q, k and v conv weights as one [3P, 1, W] (fused once after loading)."""
        fused = getattr(self, "_conv_weight", None)
        if fused is not None:
            return fused
        return torch.cat((self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight))

    def gate_ups(self, f_a: torch.Tensor, g_a: torch.Tensor, both: torch.Tensor | None = None):
        """(f_b(f_a), g_b(g_a)), each [T, P]: one batched GEMM over ``both`` = [f_a | g_a] columns [T, 2K] once
        the two weights are fused, else one GEMM each."""
        w = getattr(self, "_gate_up_weight", None)
        if w is None or both is None:
            return self.f_b_proj(f_a), self.g_b_proj(g_a)
        fg = gate_ups(both, w)  # [2, T, P]
        return fg[0], fg[1]

    def forward(self, x: torch.Tensor, batch, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``projected``: ``fused_in(x)`` when the caller computed it (with the input norm, DecoderLayer._mix)."""
        T, H, K, P = x.shape[0], self.H, self.K, self.P
        fused = self._modules.get("fused_in")
        both = None
        gate_up = getattr(self, "_gate_up_weight", None)
        if fused is not None:  # [q | k | v | f_a | g_a | b] columns of one GEMM: q, k, v side by side already
            proj = fused(x, split=False) if projected is None else projected
            if batch.is_decode and gate_up is not None:  # conv, gates and delta rule as one op
                o, gate = ops.call("kda_decode", proj, self.conv_weight(), self.cache["conv"], gate_up, self.A_log,
                                   self.dt_bias, self.lower_bound, K**-0.5, self.cache["state"], batch)
                return self._output(o, gate)
            qkv, both, b = proj.split([3 * P, 2 * K, H], dim=-1)
            f_a, g_a = both.split([K, K], dim=-1)
        else:
            q, k, v, f_a, g_a, b = project(self, "fused_in", self.in_proj_members, x)
            qkv = torch.cat((q, k, v), dim=-1)
        q, k, v = (t.view(T, H, K) for t in self.conv("conv", qkv, self.conv_weight(), batch, groups=3))
        f, gate = self.gate_ups(f_a, g_a, both)
        # the forget gate's input [T, H, K] and beta's logits [T, H]: the op applies kda_gate and the sigmoid
        o = self.delta_rule(q, k, v, f.view(T, H, K), b, K**-0.5, batch,
                            gate=(self.A_log, self.dt_bias, self.lower_bound))
        return self._output(o, gate)

    def _output(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated output norm and the output projection of o [T, H, V] with the output gate [T, P]."""
        T, H, K = o.shape
        gate = gate.view(T, H, K)
        y = fused_product(self.o_proj, lambda w, bias: ops.call("rms_norm_gated_linear", o, self.o_norm.weight, gate,
                                                                 self.eps, w, bias))
        if y is not None:  # the gated norm inside the output projection
            return y
        o = ops.call("rms_norm_gated", o, self.o_norm.weight, gate, self.eps)  # [T, H, V]
        return self.o_proj(o.reshape(T, H * K))
