"""Reference activations (pure PyTorch, fp32 math, result in the input's dtype).

The MLP and MoE references call these helpers, so a dense MLP and an expert compute the same
activation bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import register


@register("silu_and_mul")
def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU: ``SiLU(gate) * up`` where ``x = [gate | up]`` along the last dim. With ``limit`` (HY-V4 and
    DeepSeek-V4 experts) ``gate = min(gate, limit)`` and ``up = clamp(up, ±limit)`` first."""
    # x: [..., 2I] -> [..., I]
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim [gate | up], got {tuple(x.shape)}")
    gate, up = x.float().chunk(2, dim=-1)
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (F.silu(gate) * up).to(x.dtype)


@register("relu2")
def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU ``ReLU(x)^2`` (Nemotron-H experts, non-gated)."""
    # x: [..., I] -> [..., I]
    return torch.relu(x.float()).square().to(x.dtype)


@register("swiglu_oai")
def swiglu_oai(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """gpt-oss SwiGLU on ``x = [gate | up]``: ``gate=min(gate, limit)``, ``up=clamp(up, ±limit)``,
    ``out = gate·σ(alpha·gate)·(up + 1)`` (ARCHITECTURE.md 4; the checkpoint interleaves gate/up rows,
    the loader de-interleaves them into halves)."""
    gate, up = x.float().chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (gate * torch.sigmoid(alpha * gate) * (up + 1)).to(x.dtype)


@register("sigmoid_gate")
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(gate)``: the output gate of gated attention (per channel, or per head with a gate of width
    1) and of a shared expert; fp32 math, the result in x's dtype."""
    # x: [T, H, V]; gate: [T, H, V] or [T, H, 1] (any strides) -> [T, H, V]
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)
