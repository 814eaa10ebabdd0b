"""Dense gated MLP: ``down(act(gate x) * up x)`` with gate and up fused in one [2I, D] weight."""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, activation: str = "silu"):
        super().__init__()
        self.activation = activation
        rows = 2 * intermediate if activation == "silu" else intermediate
        self.gate_up_proj = nn.Linear(hidden, rows, bias=False)  # [gate; up] rows, or [up] for relu2
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.call("mlp", x, self.gate_up_proj.weight, self.down_proj.weight, self.activation)
