"""MLA (DeepSeek-V3 multi-head latent attention) over a latent cache, naive and absorbed forms.

The cache holds per token ``latent = [c (R) | k_pe (P)]``: c already RMS-normalised, k_pe already
RoPE-rotated. ``kv_b_weight`` is kv_b_proj's nn.Linear weight [H*(N+Vd), R], head-major: per head
the first N rows make k_nope, the next Vd rows make v.

- naive (MHA) form: k_nope, v = kv_b(c); k = [k_nope | k_pe on every head]; attention with H kv heads.
- absorbed (MQA) form: q~ = [q_nope W_UK (R) | q_pe]; one kv head k = latent, v = c;
  o_h = W_UV,h o~_h. Same result, and the cache is never expanded to H heads.

Both run ``attention``, so key masks (DSA top-k), sinks and the fp32 math come from there.
"""
from __future__ import annotations

import torch

from dayzero.ops.attention.reference import attention
from dayzero.ops.registry import register


def _split_kv_b(kv_b_weight: torch.Tensor, H: int, N: int, Vd: int, R: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj weight -> fp32 W_UK [H, N, R] and W_UV [H, Vd, R]."""
    assert kv_b_weight.shape == (H * (N + Vd), R), (
        f"kv_b_weight {tuple(kv_b_weight.shape)} is not [H*(N+Vd), R] = [{H * (N + Vd)}, {R}]"
    )
    w = kv_b_weight.float().view(H, N + Vd, R)
    return w[:, :N], w[:, N:]


@register("mla_naive")
def mla_naive(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    q_pos: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q_nope: [Tq, H, N]; q_pe: [Tq, H, P]; latent: [S, R+P]; returns [Tq, H, Vd] in q_nope's dtype
    Tq, H, N = q_nope.shape
    P = q_pe.shape[-1]
    S, R = latent.shape[0], latent.shape[1] - P
    w_uk, w_uv = _split_kv_b(kv_b_weight, H, N, v_head_dim, R)
    c, k_pe = latent.float().split([R, P], dim=-1)
    k_nope = torch.einsum("sr,hnr->shn", c, w_uk)  # [S, H, N]
    v = torch.einsum("sr,hvr->shv", c, w_uv)  # [S, H, Vd]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, H, P)], dim=-1)  # [S, H, N+P]
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)  # [Tq, H, N+P]
    return attention(q, k, v, q_pos, scale, key_mask=key_mask, sinks=sinks)


@register("mla_absorbed")
def mla_absorbed(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    latent: torch.Tensor,
    kv_b_weight: torch.Tensor,
    v_head_dim: int,
    q_pos: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    # q_nope: [Tq, H, N]; q_pe: [Tq, H, P]; latent: [S, R+P]; returns [Tq, H, Vd] in q_nope's dtype
    Tq, H, N = q_nope.shape
    P = q_pe.shape[-1]
    R = latent.shape[1] - P
    w_uk, w_uv = _split_kv_b(kv_b_weight, H, N, v_head_dim, R)
    # q~ stays fp32: the absorbed query is an intermediate, rounding it would break naive == absorbed
    q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), w_uk)  # [Tq, H, R]
    q_abs = torch.cat([q_lat, q_pe.float()], dim=-1)  # [Tq, H, R+P]
    lat = latent.float()
    k = lat[:, None, :]  # [S, 1, R+P]: one kv head shared by all H query heads
    v = lat[:, None, :R]  # [S, 1, R]
    o_lat = attention(q_abs, k, v, q_pos, scale, key_mask=key_mask, sinks=sinks)  # [Tq, H, R] fp32
    return torch.einsum("thr,hvr->thv", o_lat, w_uv).to(q_nope.dtype)
