"""RoPE frequencies, plain or YaRN (ARCHITECTURE.md 2.1), computed per position on the fly.

Tables are not precomputed for every position: with 1M-token contexts a [1M, D/2] table per layer kind
would be hundreds of MB, while ``positions ⊗ inv_freq`` for the tokens of one step is tiny.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.config.model_config import RopeScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolation = 1.0 / base**exps
    interpolation = extrapolation / s.factor

    def corr_dim(n_rot: float) -> float:  # the dim whose wavelength makes n_rot turns in the original context
        return dim * math.log(s.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(s.beta_fast)), 0)
    high = min(math.ceil(corr_dim(s.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep_extra = 1.0 - ramp  # 1 for high-frequency dims (kept), 0 for low-frequency (interpolated)
    return interpolation * (1 - keep_extra) + extrapolation * keep_extra


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float, scaling: RopeScaling | None = None, interleaved: bool = False):
        super().__init__()
        self.dim, self.interleaved = dim, interleaved
        if scaling is None or scaling.factor <= 1:
            inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
            self.cos_scale = 1.0
        else:
            inv = _yarn_inv_freq(dim, base, scaling)
            self.cos_scale = yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, dim/2] fp32 (fp32 keeps positions near 1M exact enough)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.cos_scale, freqs.sin() * self.cos_scale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return ops.call("rotary", x, cos, sin, self.interleaved)


def softmax_scale(head_dim: int, scaling: RopeScaling | None) -> float:
    """1/sqrt(d), times mscale² when YaRN is configured (the HF convention, ARCHITECTURE.md 2.1)."""
    scale = head_dim**-0.5
    if scaling is not None and scaling.factor > 1 and scaling.mscale_all_dim:
        scale *= yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2
    return scale
