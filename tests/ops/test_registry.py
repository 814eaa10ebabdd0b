"""The ops registry: platform choice, verifier fallback with a reason, overrides."""
from __future__ import annotations

import pytest
import torch

from dayzero import ops
from dayzero.ops import registry


def test_every_model_op_has_a_reference():
    need = {"rms_norm", "rms_norm_gated", "layer_norm", "rotary", "attention", "mla_naive", "mla_absorbed",
            "indexer_topk", "kda_gate", "causal_conv1d", "kda_chunk", "kda_recurrent", "moe_route", "moe_permute",
            "moe_experts_grouped", "moe_unpermute", "moe_experts", "mlp", "silu_and_mul"}
    have = ops.registered()
    assert need <= set(have), need - set(have)
    assert all(registry.REFERENCE in have[n].impls for n in need)


def test_platform_impl_verifier_and_override(monkeypatch):
    calls = []
    registry.register("_toy")(lambda x: calls.append("ref") or x)
    registry.register("_toy", "cpu", verifier=lambda x: None if x.shape[0] % 2 == 0 else "odd rows unsupported")(
        lambda x: calls.append("cpu") or x)
    ops.call("_toy", torch.zeros(2))
    ops.call("_toy", torch.zeros(3))
    assert calls == ["cpu", "ref"]
    assert registry.choose("_toy", "cpu", torch.zeros(3))[2] == "odd rows unsupported"
    assert registry.choose("_toy", "cuda", torch.zeros(2))[2] == "no cuda implementation"
    registry.override("_toy", "reference")
    try:
        ops.call("_toy", torch.zeros(2))
    finally:
        registry.override("_toy", None)
    monkeypatch.setenv("DAYZERO_OPS", "_toy=reference")
    ops.call("_toy", torch.zeros(2))
    assert calls[2:] == ["ref", "ref"]
    monkeypatch.setenv("DAYZERO_OPS", "_toy=tpu")
    with pytest.raises(KeyError, match="no 'tpu' implementation"):
        ops.call("_toy", torch.zeros(2))
