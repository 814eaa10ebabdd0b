"""benchmarks/decode_linear.py's shape list on the CPU: a decode step of dayzero-small runs one fused input projection
per mixer and LatentMoE block and one router GEMV per MoE layer through the ``linear`` op; the fused ops' shapes."""
from __future__ import annotations

import torch

from benchmarks.decode_linear import fused_shapes, step_shapes
from dayzero.models.registry import load_config


def test_dayzero_small_shapes_and_counts():
    spec = load_config("configs/dayzero-small.json")
    kinds = [layer.attn_kind for layer in spec.layers]
    moe = sum(layer.mlp_kind == "moe" for layer in spec.layers)
    shapes = step_shapes("configs/dayzero-small.json", torch.bfloat16)
    assert sum(shapes.values()) == len(kinds) + 2 * moe  # every mixer, and each MoE layer's input GEMM and router
    router = {s: c for s, c in shapes.items() if s[3] == torch.float32}
    assert list(router.values()) == [moe]
    assert next(iter(router))[:3] == (spec.layers[-1].mlp.n_experts, spec.hidden_size, torch.float32)
    assert all(k == spec.hidden_size for _, k, _, _ in shapes)


def test_dayzero_small_fused_op_shapes_and_counts():
    """The norm inside every mixer's and MoE block's fused projection, the activation inside the dense MLP's down
    projection, KDA's gated norm inside its output projection, each LatentMoE up-projection with its shared expert."""
    spec = load_config("configs/dayzero-small.json")
    kda = sum(layer.attn_kind == "kda" for layer in spec.layers)
    moe = sum(layer.mlp_kind == "moe" for layer in spec.layers)
    shapes = fused_shapes("configs/dayzero-small.json", torch.bfloat16)
    count = {op: sum(c for s, c in shapes.items() if s[0] == op) for op in {s[0] for s in shapes}}
    assert count == {"rms_norm_linear": len(spec.layers) + moe, "act_linear": len(spec.layers) - moe,
                     "rms_norm_gated_linear": kda, "dual_linear": moe, "moe_router": moe,
                     "sigmoid_gate_linear": len(spec.layers) - kda}  # the gated DSA layers
    assert shapes[("rms_norm_gated_linear", spec.hidden_size, 2048, 128)] == kda
    mlp = spec.layers[-1].mlp
    assert shapes[("dual_linear", spec.hidden_size, mlp.latent_size + mlp.shared_intermediate_size,
                   mlp.shared_intermediate_size)] == moe
