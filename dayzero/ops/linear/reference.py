"""Reference linear: cuBLAS through ``F.linear`` / ``addmm`` (fp32 accumulation), in fp32 where the operands'
dtypes differ."""
from __future__ import annotations

import torch

from dayzero.ops.registry import call, register


@register("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """``x · weightᵀ + bias + add`` in ``out_dtype`` (default ``x.dtype``). Operands all of the output's dtype go to
    the GEMM as they are (``add`` in its epilogue when x is 2-D and there is no bias: the shared expert added to the
    LatentMoE up-projection); otherwise they are read in fp32 (the router's fp32 logits of bf16 tokens)."""
    # x: [..., K]; weight: [N, K]; bias: [N]; add: [..., N] -> [..., N]
    out = out_dtype or x.dtype
    if x.dtype == weight.dtype == out and all(t is None or t.dtype == out for t in (bias, add)):
        if add is None:
            return torch.nn.functional.linear(x, weight, bias)
        if bias is None and x.dim() == 2:
            return torch.addmm(add, x, weight.t())
        return torch.nn.functional.linear(x, weight, bias) + add
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return (y if add is None else y + add.float()).to(out)


@register("rms_norm_linear")
def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    """``rms_norm`` (with the residual added first) then ``linear`` of the normalised rows (in ``out_dtype``,
    default x's): returns (the projection, the normalised rows, the residual sum), the sum being ``x`` itself
    without a residual. Each step is its own op here (and so its own kernels on a device); a decode layer's input
    norm and first projection, or its MoE router (fp32 logits)."""
    # x, residual: [..., K]; norm_weight: [K]; weight: [N, K] -> ([..., N], [..., K], [..., K])
    normed, res = call("rms_norm", x, norm_weight, eps, residual)
    return call("linear", normed, weight, bias, out_dtype=out_dtype), normed, res


@register("act_linear")
def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu",
               limit: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """An MLP's activation then its down projection, ``linear(act(x), weight, bias, add=add)``: ``activation`` is
    ``silu`` (``silu_and_mul`` of [gate | up] rows, clamped at ``limit`` when given), ``swiglu_oai`` (gpt-oss, its
    clamp ``limit`` 7 unless given) or ``relu2``. Each step is its own op here (and so its own kernels on a device)."""
    # x: [..., 2I] ([..., I] for relu2); weight: [N, I]; bias: [N]; add: [..., N] -> [..., N]
    if activation == "silu":
        h = call("silu_and_mul", x, limit)
    elif activation == "swiglu_oai":
        h = call("swiglu_oai", x, limit=7.0 if limit is None else limit)
    elif activation == "relu2":
        h = call("relu2", x)
    else:
        raise ValueError(f"unknown activation {activation!r}: silu, swiglu_oai or relu2")
    return call("linear", h, weight, bias, add=add)


@register("rms_norm_gated_linear")
def rms_norm_gated_linear(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm_gated`` over each head, then ``linear`` of the heads side by side: KDA's gated output norm and its
    output projection. Each step is its own op here (and so its own kernels on a device)."""
    # x, gate: [T, H, V]; norm_weight: [V]; weight: [N, H*V] -> [T, N]
    o = call("rms_norm_gated", x, norm_weight, gate, eps)
    return call("linear", o.reshape(x.shape[0], -1), weight, bias)


@register("dual_linear")
def dual_linear(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                activation: str | None = None, limit: float | None = None) -> torch.Tensor:
    """``x · weightᵀ + act(x2) · weight2ᵀ``: two projections of different inputs summed, the second through
    ``act_linear`` when an ``activation`` is given (a LatentMoE block's up-projection plus its shared expert's
    activation and down projection). Here the second is the first's ``add`` (and so each its own kernels)."""
    # x: [T, K]; weight: [N, K]; x2: [T, K2] ([T, 2 K2] for a gated activation); weight2: [N, K2] -> [T, N]
    other = (call("linear", x2, weight2) if activation is None
             else call("act_linear", x2, weight2, None, activation, limit))
    return call("linear", x, weight, add=other)


@register("sigmoid_gate_linear")
def sigmoid_gate_linear(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sigmoid_gate`` then ``linear`` of the heads side by side: gated attention's output gate (per channel, or
    one per head) and its output projection. Each its own op here (and so its own kernels on a device)."""
    # x: [T, H, V]; gate: [T, H, V] or [T, H, 1] (any strides); weight: [N, H*V] -> [T, N]
    return call("linear", call("sigmoid_gate", x, gate).reshape(x.shape[0], -1), weight, bias)
