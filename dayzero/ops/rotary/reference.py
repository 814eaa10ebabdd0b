"""Rotary position embedding (RoPE), NeoX (rotate-half) and interleaved (complex-pair) layouts.

``cos``/``sin`` are [T, D/2] fp32 tables for each token's position (see ``layers/rotary.py`` for
the frequencies, including YaRN). The rotation is computed in fp32 and cast back.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("rotary")
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 start: int | None = None) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, D/2]. With ``start``, only channels start .. start + R of each head are rotated
    (R = 2 · cos.shape[-1], a partial rotary) and the others pass through."""
    if start is not None:
        R = 2 * cos.shape[-1]
        head, rot, tail = x.split([start, R, x.shape[-1] - start - R], dim=-1)
        return torch.cat((head, apply_rotary(rot, cos, sin, interleaved), tail), dim=-1)
    xf = x.float()
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
