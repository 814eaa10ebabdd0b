"""A KDA layer's decode step after its input projection, as one op: ``kda_decode``.

From the fused projection's rows ``[q | k | v | f_a | g_a | b]`` (one token per sequence) it runs the short conv
of q, k and v (each sequence's window continued and updated in its slot), the forget gate's and the output gate's
low-rank up-projections, the gate and beta activations, and the delta rule from each sequence's state (updated
in its slot), and returns the output [B, H, V] and the output gate [B, P] for the gated norm. Apart these are
four kernels or more (the conv, a batched GEMM of the two up-projections, a copy of beta's strided logits, the
recurrent kernel); :mod:`dayzero.ops.kda.decode_kernels` does it in one launch on a GPU. The composition here
calls the ops apart, so where the one kernel refuses each part still runs its best implementation.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import call, register


def split_projection(proj: torch.Tensor, state_pool: torch.Tensor):
    """(H, K, P) of a KDA layer from its state pool [slots, H, K, K], checking the projection's width."""
    H, K = state_pool.shape[1], state_pool.shape[2]
    P = H * K
    if proj.dim() != 2 or proj.shape[-1] != 3 * P + 2 * K + H:
        raise ValueError(f"the projection must be [T, 3P + 2K + H] = [T, {3 * P + 2 * K + H}] for {H} heads of "
                         f"{K}, got {list(proj.shape)}")
    return H, K, P


def gate_ups(both: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The forget gate's and the output gate's up-projections of ``both`` = [f_a | g_a] [T, 2K] by their weights
    ``gate_up`` [2, P, K], as one batched GEMM: [2, T, P]."""
    K = gate_up.shape[-1]
    return torch.bmm(both.reshape(-1, 2, K).transpose(0, 1), gate_up.transpose(1, 2))


@register("kda_decode")
def kda_decode(proj: torch.Tensor, conv_weight: torch.Tensor, conv_pool: torch.Tensor, gate_up: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, scale: float,
               state_pool: torch.Tensor, batch) -> tuple[torch.Tensor, torch.Tensor]:
    # proj: [B, 3P + 2K + H]; conv_weight: [3P, 1, W]; conv_pool: [slots, 3P, W-1]; gate_up: [2, P, K] (the
    # forget gate's and the output gate's up-projections); state_pool: [slots, H, K, K] fp32
    # -> o [B, H, K] and the output gate [B, P], both in proj's dtype
    H, K, P = split_projection(proj, state_pool)
    T = proj.shape[0]
    qkv, both, b = proj.split([3 * P, 2 * K, H], dim=-1)
    q, k, v = (t.view(T, H, K) for t in call("causal_conv1d_pooled", qkv, conv_weight, conv_pool, batch, "silu", 3,
                                              reset=state_pool))
    fg = gate_ups(both, gate_up)  # [2, T, P]
    o = call("kda_pooled", q, k, v, fg[0].view(T, H, K), b, scale, state_pool, batch, True,
             gate=(A_log, dt_bias, lower_bound), zeroed=True)
    return o, fg[1]
