"""Normalisation layers; the math lives in ``ops/norm``."""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=True`` for zero-centred weights stored as w, applied as (1 + w) (Qwen3-Next)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def scale(self) -> torch.Tensor:
        return self.weight.float() + 1.0 if self.offset else self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: RMSNorm(x). With it: (RMSNorm(x + residual), x + residual), fused."""
        y, res = ops.call("rms_norm", x, self.scale(), self.eps, residual)
        return y if residual is None else (y, res)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.call("layer_norm", x, self.weight, self.bias, self.eps)
