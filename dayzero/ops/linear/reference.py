"""``linear_fp32``: a linear kept in fp32 whatever the model dtype (the MoE router, the DSA indexer's head
weights: ARCHITECTURE.md 2.2 and 3.1, selections are sensitive to rounding)."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("linear_fp32")
def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
    """``(x · Wᵀ + b) · scale`` in fp32: x [..., K] in any float dtype, W [N, K] -> [..., N] fp32."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y * scale if scale != 1.0 else y
