"""The CUDA routed experts (one grouped GEMM per projection) against the fp32 reference, and the fallbacks."""
from __future__ import annotations

import pytest
import torch

from dayzero import ops
from dayzero.ops.moe.reference import grouped_experts as reference
from dayzero.ops.registry import choose

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="needs torch's grouped_mm")]


def case(T, E, k, D, inter, activation, bias=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = inter if activation == "relu2" else 2 * inter
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = r(T, D).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g, device="cuda")[:k] for _ in range(T)])  # expert E-1 unused
    w = torch.rand(T, k, generator=g, device="cuda")
    w1, w2 = (0.1 * r(E, rows, D)).to(dtype), (0.1 * r(E, D, inter)).to(dtype)
    b1, b2 = (r(E, rows), r(E, D)) if bias else (None, None)
    return x, ids, w, w1, w2, b1, b2


@pytest.mark.parametrize("activation,bias,limit", [("silu", False, None), ("silu", False, 0.5), ("relu2", False, None),
                                                    ("swiglu_oai", True, None)])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_grouped_gemm_matches_reference(T, activation, bias, limit):
    x, ids, w, w1, w2, b1, b2 = case(T, 8, 2, 64, 48, activation, bias, seed=T)
    kw = {} if limit is None else {"limit": limit}
    chosen, impl, why = choose("moe_experts", "cuda", x, ids, w, w1, w2, activation, b1, b2, **kw)
    assert chosen == "cuda", why
    out = ops.call("moe_experts", x, ids, w, w1, w2, activation, b1, b2, **kw)
    ref = reference(x, ids, w, w1, w2, activation, b1, b2, **kw).float()
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert out.dtype == torch.bfloat16 and rel < 1e-2, rel  # bf16 rounding of the output and of act(h)


def test_falls_back_with_a_reason():
    x, ids, w, w1, w2, _, _ = case(5, 8, 2, 64, 48, "silu")
    assert choose("moe_experts", "cuda", x.float(), ids, w, w1.float(), w2.float())[0] == "reference"
    chosen, _, why = choose("moe_experts", "cuda", x, ids, w, w1[:, :, :60], w2)
    assert chosen == "reference" and "multiples of 8" in why
