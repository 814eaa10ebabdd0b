"""Decode steps of the pooled linear-attention ops on the device (KDA and Gated DeltaNet, the short causal
conv): every sequence advances one token from the state in its slot, read with one gather and written back
with one ``index_copy_`` into the pool, ``fresh`` sequences reset on the device. Fixed shapes, no host round
trip: they run inside captured CUDA graphs. Prefill chunks are refused (the reference's chunk form runs them).

Padding rows of a captured step all use the null slot 0; ``index_copy_`` with repeated indices leaves that
slot holding one of them, which nothing reads.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.attention.cuda import _decode_only
from dayzero.ops.kda.reference import _prep, pooled_state
from dayzero.ops.registry import register


@register("kda_pooled", "cuda", verifier=lambda q, k, v, g, b, s, pool, batch, *a, **kw: _decode_only(batch),
          note="one recurrent step for every decode row, state updated in the pool (PyTorch)")
def kda_pooled_decode(q, k, v, g, beta, scale: float, state_pool: torch.Tensor, batch, use_qk_l2norm: bool = True):
    # q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state_pool: [slots, H, K, V] fp32 -> o [B, H, V]
    out_dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    S = pooled_state(state_pool, batch) * g.exp()[..., None]  # decay the rows (K dim)
    err = v - torch.einsum("bhkv,bhk->bhv", S, k)  # v - S^T k
    S = S + (beta[..., None] * k)[..., None] * err[:, :, None, :]
    state_pool.index_copy_(0, batch.state_slots, S)
    return torch.einsum("bhkv,bhk->bhv", S, q).to(out_dtype)


@register("causal_conv1d_pooled", "cuda", verifier=lambda x, w, pool, batch, *a, **kw: _decode_only(batch),
          note="one conv step for every decode row, window updated in the pool (PyTorch)")
def causal_conv1d_pooled_decode(x, weight, window_pool: torch.Tensor, batch, activation: str | None = "silu"):
    # x: [B, C]; weight: [C, W] (or [C, 1, W]); window_pool: [slots, C, W-1] -> y [B, C]
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    C = x.shape[1]
    u = torch.cat((pooled_state(window_pool, batch).float(), x.float()[:, :, None]), dim=2)  # [B, C, W], oldest first
    y = (u * weight.float().reshape(C, -1)).sum(-1)
    window_pool.index_copy_(0, batch.state_slots, u[:, :, 1:].to(window_pool.dtype))
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
