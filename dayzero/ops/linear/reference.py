"""Reference linear: cuBLAS through ``F.linear`` (fp32 accumulation), in fp32 where the operands' dtypes differ."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x · weightᵀ + bias`` in ``out_dtype`` (default ``x.dtype``). Operands all of the output's dtype go to the
    GEMM as they are; otherwise they are read in fp32 (the router's fp32 logits of bf16 tokens)."""
    # x: [..., K]; weight: [N, K]; bias: [N] -> [..., N]
    out = out_dtype or x.dtype
    if x.dtype == weight.dtype == out and (bias is None or bias.dtype == out):
        return torch.nn.functional.linear(x, weight, bias)
    return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(out)
