"""Reference normalisations (pure PyTorch, fp32 math, result in the input's dtype).

All of them normalise over the last dim only; a per-head norm reshapes to ``[..., H, d]`` first.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


def _rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    # h: [..., D] fp32 -> h / sqrt(mean(h^2) + eps)
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)


@register("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with an optional fused residual add; returns ``(y, residual_out)``. ``weight=None``: no
    scale (DeepSeek-V4's per-head query norm).

    With ``residual``: ``h = x + residual`` is summed in fp32 and rounded once to ``x.dtype``;
    that rounded ``h`` is both ``residual_out`` (what the next layer adds to) and what is
    normalised, so the fused call equals ``rms_norm(x + residual)`` as an unfused model computes it.
    Without: ``residual_out = x``.
    """
    # x, residual: [..., D]; weight: [D]
    if residual is None:
        residual_out = x
    else:
        residual_out = (x.float() + residual.float()).to(x.dtype)
    y = _rms(residual_out.float(), eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), residual_out


@register("rms_norm_gated")
def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm(x) * weight * sigmoid(gate)``, the gate applied after the norm (KDA output norm)."""
    # x, gate: [..., V]; weight: [V]
    y = _rms(x.float(), eps) * weight.float() * torch.sigmoid(gate.float())
    return y.to(x.dtype)


@register("layer_norm")
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, biased variance (the DSA indexer's ``k_norm``)."""
    # x: [..., D]; weight, bias: [D] or None
    h = x.float()
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).square().mean(-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
