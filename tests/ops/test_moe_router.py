"""``moe_router``: the router GEMV and its routing in one launch (the program that finishes last routes every
row) against the two ops apart, for the routing kinds the routing kernel takes, odd expert counts and several
programs; the launch counter back at zero after each launch; the refusals; on a CUDA device the measured choice at
dayzero-small's router. On the CPU the kernel runs through Triton's interpreter (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from dayzero import ops
from dayzero.ops import triton_support
from dayzero.ops.linear import kernels as L
from dayzero.ops.moe import router_kernels as R
from dayzero.ops.moe.reference import moe_router as reference

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CASES = {"v3": dict(E=64, k=8, G=8, TG=4, bias=True), "flat": dict(E=40, k=4, G=1, TG=1, bias=False),
         "v4": dict(E=48, k=8, G=1, TG=1, bias=True, kind="sqrtsoftplus"), "odd": dict(E=12, k=2, G=3, TG=2, bias=True)}


def operands(M, E, D, case, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(M, D, generator=g, device=DEV).to(dtype)
    w = torch.randn(E, D, generator=g, device=DEV) / D ** 0.5 * 3  # fp32, as routers are kept
    corr = 0.1 * torch.randn(E, generator=g, device=DEV) if case["bias"] else None
    return x, w, (case["k"], case.get("kind", "sigmoid"), corr, case["G"], case["TG"])


def same_routing(got, want):
    (w, ids), (w_ref, ids_ref) = got, want
    assert torch.equal(ids.sort(-1).values, ids_ref.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), w_ref.gather(1, ids_ref.argsort(-1)), rtol=1e-4,
                               atol=1e-6)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("norm", [True, False])
def test_one_launch_routes_like_the_two_ops(case, M, norm):
    c = CASES[case]
    x, w, (k, kind, corr, G, TG) = operands(M, c["E"], 96, c, seed=M)
    gate_bias = torch.randn(c["E"], device=DEV) * 0.1 if case == "flat" else None  # a router with a bias
    want = reference(x, w, gate_bias, k, kind, corr, G, TG, norm, 2.5)
    for block in R.candidates(M, c["E"], 96) + [(4, 32, 4)]:  # several K steps and programs; a ragged last block
        got = R.router_route(x, w, gate_bias, k, kind, corr, G, TG, norm, 2.5, block)
        same_routing(got, want)
        assert R._counter(w).item() == 0  # the last program put the counter back


def test_refusals_name_the_reason():
    c = CASES["v3"]
    x, w, (k, kind, corr, G, TG) = operands(2, 64, 32, c)
    assert "rows" in R._verify(x.repeat(5, 1), w, None, k, kind, corr, G, TG)
    assert "softmax" in R._verify(x, w, None, k, "softmax", None, 1, 1)
    assert "power of two" in R._verify(x, w, None, 3, kind, corr, G, TG)
    with torch.no_grad():
        if DEV == "cpu":  # the CPU keeps the two ops, whose result the op then gives
            assert "apart" in R._verify(x, w, None, k, kind, corr, G, TG)
            same_routing(ops.call("moe_router", x, w, None, k, kind, corr, G, TG), reference(x, w, None, k, kind, corr,
                                                                                           G, TG))


def test_the_timings_run_every_launch_they_compare(monkeypatch):
    """What the op times at a key's first eager call on a GPU, run here eagerly: every launch routes alike, and the
    weight copies' counters are dropped after."""
    outputs = []

    def eager(calls, replays=5):
        outputs.append([c() for c in calls][0])
        return float(len(outputs))

    monkeypatch.setattr(L, "graph_time", eager)
    monkeypatch.setattr(L, "cold_copies", lambda w: [w, w.clone()])
    monkeypatch.setattr(L, "measured_choice", lambda *a, **k: None)  # the linear apart: its own choice, untimed
    c = CASES["v3"]
    x, w, args = operands(2, 64, 64, c)
    before = set(R._COUNTERS)
    times = R.timings(x, w, None, *args)
    assert None in times and len(times) == len(outputs) >= 2
    for got in outputs[1:]:
        same_routing(got, outputs[0])
    assert set(R._COUNTERS) - before <= {(w.device, w.data_ptr())}


@cuda
@pytest.mark.parametrize("M", [1, 2, 4])
def test_measured_choice_at_dayzero_smalls_router(M):
    c = CASES["v3"]
    x, w, (k, kind, corr, G, TG) = operands(M, 64, 2048, c)
    want = reference(x, w, None, k, kind, corr, G, TG, True, 2.5)
    choice = R.measured_choice(x, w, None, k, kind, corr, G, TG, True, 2.5)
    assert choice is None or choice in R.candidates(L.next_pow2(M), 64, 2048)
    same_routing(ops.call("moe_router", x, w, None, k, kind, corr, G, TG, True, 2.5), want)
    assert R._counter(w).item() == 0
