"""Dense MLP: ``down(act(gate x) * up x)`` with gate and up fused in one [2I, D] weight (or ``down(relu(up x)²)``).

Under tensor parallelism gate/up are column-parallel (a rank holds [gate_r; up_r], I/tp rows of each) and down is
row-parallel: the activation needs no communication and the block ends in one all-reduce of [T, D].
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import MLPSpec
from dayzero.distributed import SINGLE, ParallelState, tp_all_reduce
from dayzero.layers.fused import local_gemm
from dayzero.layers.parallel import PLAIN_LINEARS, RowParallelLinear, column_linear, fused_product, row_linear


class MLP(nn.Module):
    def __init__(self, hidden: int, spec: MLPSpec, parallel: ParallelState = SINGLE, what: str = "intermediate_size"):
        super().__init__()
        self.activation = spec.activation
        self.clamp = {} if spec.swiglu_limit is None else {"limit": spec.swiglu_limit}
        self.parallel = parallel
        I = spec.intermediate_size
        parts = 1 if spec.activation == "relu2" else 2
        # [gate; up] rows, or [up] for relu2; at tp>1 each part cut by rank
        self.gate_up_proj = column_linear(hidden, parts * I, spec.bias, parallel, what=what, parts=parts)
        self.down_proj = row_linear(I, hidden, spec.bias, parallel, what=what)

    def down(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The rest of the MLP after ``gate_up_proj`` (computed by the caller, e.g. in a fused GEMM): the activation
        and the down projection as one ``act_linear`` (one kernel on a decode step's rows where measured faster)."""
        y = fused_product(self.down_proj, lambda w, b: ops.call("act_linear", gate_up, w, b, self.activation,
                                                                 **self.clamp))
        if y is not None:
            return y
        if self.activation == "silu":
            return self.down_proj(ops.call("silu_and_mul", gate_up, **self.clamp))
        return self.down_proj(ops.call("relu2", gate_up))

    def forward(self, x: torch.Tensor, batch=None) -> torch.Tensor:
        # ``batch`` is unused: every MLP kind takes the step's batch (hash-routed MoE reads its token ids)
        down = self.down_proj
        plain = local_gemm(self.gate_up_proj) and (type(down) in PLAIN_LINEARS or type(down) is RowParallelLinear)
        if plain and self.gate_up_proj.bias is None and down.bias is None:
            y = ops.call("mlp", x, self.gate_up_proj.weight, down.weight, self.activation, **self.clamp)
            return tp_all_reduce(y, self.parallel)  # the row-parallel down's sum over ranks (identity at tp=1)
        return self.down(self.gate_up_proj(x))  # biases, or block-FP8 linears that dequantise their own weights
