"""Which weights a kernel may read before waiting for the kernel before it: parameters and tensors marked where
they are made, never a view made per call, and none with ``DAYZERO_WEIGHT_PRELOAD=0``."""
from __future__ import annotations

import torch

from dayzero.ops.static import is_static, mark_static, preload


def test_parameters_and_marked_weights_only(monkeypatch):
    x = torch.zeros(1, 4)
    plain = torch.zeros(2, 4)
    param = torch.nn.Parameter(torch.zeros(2, 4), requires_grad=False)
    assert not preload(x, plain)["PRELOAD"]
    assert preload(x, param)["PRELOAD"]
    assert preload(x, param)["PDL"] is False  # the CPU: no programmatic launch, the early read only moves a load
    assert mark_static(plain) is plain and is_static(plain) and preload(x, plain)["PRELOAD"]
    assert not is_static(plain[:1]) and not is_static(plain.view(8))  # a view may be of anything
    monkeypatch.setenv("DAYZERO_WEIGHT_PRELOAD", "0")
    assert not preload(x, param)["PRELOAD"]


def test_the_kda_layers_fused_gate_weight_is_marked():
    from dayzero.layers.attention.kda import KDAAttention
    from dayzero.models.registry import build_model, load_config

    model = build_model(load_config("configs/dayzero-tiny.json"), torch.float32, "cpu")
    layers = [m for m in model.modules() if isinstance(m, KDAAttention)]
    assert layers
    for m in layers:
        m.process_weights_after_loading()
        w = m._gate_up_weight
        assert w is not None and is_static(w)
