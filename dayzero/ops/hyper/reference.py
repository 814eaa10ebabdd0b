"""Hyper-connections (HY-V4, after DeepSeek-V4 without its Sinkhorn stream mixing): the residual stream is
n parallel copies ``h`` [T, n, D], and each sublayer f reads and writes it through input-dependent weights.

With ``flat = h`` viewed [T, n·D] and ``r = 1/sqrt(mean(flat²) + norm_eps)`` (an RMSNorm without weight):

    mix  = (fn · flat) · r                                  # fn [2n, n·D] -> [T, 2n]
    pre  = σ(mix[:n] · scale[0] + base[:n]) + eps           # [T, n]
    post = magnitude · σ(mix[n:] · scale[1] + base[n:]) + eps
    x    = Σ_i pre_i h_i                                    # the sublayer input [T, D]
    h'   = post ⊗ f(x) + h                                  # each copy gets its share of the output

The head that ends the stack has only the ``pre`` half (fn [n, n·D]) and returns x. Everything is fp32;
x and h' come back in h's dtype (the streams are rounded once per sublayer, as the reference does).
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("hc_pre")
def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           eps: float, magnitude: float = 2.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Collapse the streams into one sublayer input; returns ``(x [T, D], post [T, n] fp32 or None)``.
    ``fn`` [2n, n·D] with ``scale`` [2] gives the post weights too; ``fn`` [n, n·D] with ``scale`` [1] does not."""
    # h: [T, n, D]; fn: [m, n*D], m in (n, 2n); base: [m]; scale: [m // n]
    T, n, D = h.shape
    m = fn.shape[0]
    if fn.shape != (m, n * D) or m not in (n, 2 * n) or base.shape != (m,) or scale.numel() != m // n:
        raise ValueError(f"hc_pre: h {tuple(h.shape)} needs fn [n or 2n, n*D], base [m], scale [m/n]; "
                         f"got fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)}")
    flat = h.reshape(T, n * D).float()
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)  # [T, 1]
    mix = (flat @ fn.float().t()) * r  # [T, m]
    scale, base = scale.float().reshape(-1), base.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps  # [T, n]
    post = None
    if m == 2 * n:
        post = magnitude * torch.sigmoid(mix[:, n:] * scale[1] + base[n:]) + eps  # [T, n]
    x = torch.einsum("tn,tnd->td", pre, h.float())
    return x.to(h.dtype), post


@register("hc_post")
def hc_post(h: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Spread the sublayer output back: ``h'_i = post_i · y + h_i``; returns [T, n, D] in h's dtype."""
    # h: [T, n, D]; post: [T, n] fp32; y: [T, D]
    return (post.float()[:, :, None] * y.float()[:, None, :] + h.float()).to(h.dtype)
