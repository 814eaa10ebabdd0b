"""Hyper-connections (HY-V4; DeepSeek-V4's manifold-constrained mHC): the residual stream is n parallel
copies ``h`` [T, n, D], and each sublayer f reads and writes it through input-dependent weights.

With ``flat = h`` viewed [T, n·D] and ``r = 1/sqrt(mean(flat²) + norm_eps)`` (an RMSNorm without weight):

    mix  = (fn · flat) · r                                  # fn [m, n·D] -> [T, m]
    pre  = σ(mix[:n] · scale[0] + base[:n]) + eps           # [T, n]
    post = magnitude · σ(mix[n:2n] · scale[1] + base[n:2n]) + post_eps
    x    = Σ_i pre_i h_i                                    # the sublayer input [T, D]
    h'_k = post_k · f(x) + h_k                              # each copy gets its share of the output

mHC (m = (2 + n)·n rows) adds a stream mixing ``comb`` [T, n, n]: ``softmax(mix[2n:] · scale[2] + base[2n:])``
over each row, plus eps, then projected towards a doubly-stochastic matrix by Sinkhorn-Knopp (columns
normalised, then ``iters - 1`` times rows and columns, each sum offset by eps), and the update becomes

    h'_k = post_k · f(x) + Σ_j comb[j, k] · h_j

The head that ends the stack has only the ``pre`` rows (fn [n, n·D]) and returns x. Everything is fp32;
x and h' come back in h's dtype (the streams are rounded once per sublayer, as the references do).
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[.., n, n] positive matrices -> approximately doubly stochastic (columns first, ``iters`` column steps)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@register("hc_pre")
def hc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           eps: float, magnitude: float = 2.0, post_eps: float | None = None, sinkhorn_iters: int = 0,
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Collapse the streams into one sublayer input; returns ``(x [T, D], post [T, n] or None, comb [T, n, n]
    or None)``, post and comb fp32. ``fn`` rows: n (head: x only), 2n (post too) or (2 + n)·n (mHC: comb too),
    with ``scale`` [m // n] (at most 3). ``post_eps`` defaults to ``eps``."""
    # h: [T, n, D]; fn: [m, n*D]; base: [m]; scale: [1 | 2 | 3]
    T, n, D = h.shape
    m = fn.shape[0]
    parts = {n: 1, 2 * n: 2, (2 + n) * n: 3}.get(m)
    if parts is None or fn.shape != (m, n * D) or base.shape != (m,) or scale.numel() != parts:
        raise ValueError(f"hc_pre: h {tuple(h.shape)} needs fn [n, 2n or (2+n)n, n*D], base [m], scale [1, 2 or 3]; "
                         f"got fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)}")
    if parts == 3 and sinkhorn_iters < 1:
        raise ValueError("hc_pre: a stream-mixing (mHC) connection needs sinkhorn_iters >= 1")
    flat = h.reshape(T, n * D).float()
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)  # [T, 1]
    mix = (flat @ fn.float().t()) * r  # [T, m]
    scale, base = scale.float().reshape(-1), base.float()
    pre = torch.sigmoid(mix[:, :n] * scale[0] + base[:n]) + eps  # [T, n]
    post = comb = None
    if parts >= 2:
        post = magnitude * torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        post = post + (eps if post_eps is None else post_eps)  # [T, n]
    if parts == 3:
        logits = mix[:, 2 * n:] * scale[2] + base[2 * n:]  # [T, n*n]
        comb = sinkhorn(logits.view(T, n, n).softmax(-1) + eps, sinkhorn_iters, eps)  # [T, n, n]
    x = torch.einsum("tn,tnd->td", pre, h.float())
    return x.to(h.dtype), post, comb


@register("hc_post")
def hc_post(h: torch.Tensor, post: torch.Tensor, y: torch.Tensor, comb: torch.Tensor | None = None) -> torch.Tensor:
    """Spread the sublayer output back: ``h'_k = post_k · y + Σ_j comb[j, k] h_j`` (``h_k`` without comb);
    returns [T, n, D] in h's dtype."""
    # h: [T, n, D]; post: [T, n] fp32; y: [T, D]; comb: [T, n, n] fp32
    carried = h.float() if comb is None else torch.einsum("tjk,tjd->tkd", comb.float(), h.float())
    return (post.float()[:, :, None] * y.float()[:, None, :] + carried).to(h.dtype)
