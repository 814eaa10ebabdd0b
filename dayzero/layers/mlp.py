"""Dense MLP: ``down(act(gate x) * up x)`` with gate and up fused in one [2I, D] weight (or ``down(relu(up x)²)``)."""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import MLPSpec


class MLP(nn.Module):
    def __init__(self, hidden: int, spec: MLPSpec):
        super().__init__()
        self.activation = spec.activation
        self.clamp = {} if spec.swiglu_limit is None else {"limit": spec.swiglu_limit}
        I = spec.intermediate_size
        rows = I if spec.activation == "relu2" else 2 * I
        self.gate_up_proj = nn.Linear(hidden, rows, bias=spec.bias)  # [gate; up] rows, or [up] for relu2
        self.down_proj = nn.Linear(I, hidden, bias=spec.bias)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest of the MLP after ``gate_up_proj`` (computed by the caller, e.g. in a fused GEMM)."""
        if self.activation == "silu":
            return self.down_proj(ops.call("silu_and_mul", gate_up, **self.clamp))
        return self.down_proj(ops.call("relu2", gate_up))

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        # ``batch`` is unused: every MLP kind takes the step's batch (hash-routed MoE reads its token ids)
        plain = type(self.gate_up_proj) is nn.Linear and type(self.down_proj) is nn.Linear
        if plain and self.gate_up_proj.bias is None:
            return ops.call("mlp", x, self.gate_up_proj.weight, self.down_proj.weight, self.activation, **self.clamp)
        return self.down(self.gate_up_proj(x))  # biases, or block-FP8 linears that dequantise their own weights
