"""DeepSeek-V4 MoE pieces against brute force and explicit loops: sqrt-softplus routing, hash routing
(``fixed_ids``), and the dense MLP with a clamped SwiGLU (``limit``)."""
from __future__ import annotations

import math

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops import call
from tests.ops.test_moe import brute_force_choice

RTOL, ATOL = 1e-5, 1e-6  # fp32 math compared with float64 loops


def sqrt_softplus(v: float) -> float:
    return math.sqrt(math.log1p(math.exp(v)))


# ---------------------------------------------------------------- sqrt-softplus routing

def loop_weights(scores, ids, norm, factor):
    """w_j = s[id_j] / Σ_i s[id_i] · factor (a repeated id is two terms of the sum)."""
    w = [scores[e] for e in ids]
    total = sum(w) if norm else 1.0
    return [v / total * factor for v in w]


ROUTE_CASES = [  # (T, E, k, n_group, topk_group)
    (9, 16, 4, 4, 2),
    (1, 12, 3, 1, 1),
    (6, 24, 6, 8, 4),
    (5, 10, 2, 5, 1),
    (0, 8, 2, 1, 1),
]


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("T,E,k,G,TG", ROUTE_CASES,
                         ids=[f"T{T}-E{E}-k{k}-G{G}-TG{tg}" for T, E, k, G, tg in ROUTE_CASES])
def test_sqrtsoftplus_route_matches_brute_force(T, E, k, G, TG, with_bias, norm):
    g = torch.Generator().manual_seed(T * 7 + E + k)
    logits = 2 * torch.randn(T, E, generator=g)
    # a bias about as large as the spread of the scores, so it changes the choice
    bias = 0.5 * torch.randn(E, generator=g) if with_bias else None
    weights, ids = call("moe_route", logits, k, "sqrtsoftplus", bias, n_group=G, topk_group=TG,
                        norm_topk_prob=norm, routed_scaling_factor=1.5)
    assert weights.shape == ids.shape == (T, k) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    for t in range(T):
        scores = [sqrt_softplus(v) for v in logits[t].tolist()]
        assert set(ids[t].tolist()) == brute_force_choice(scores, k, bias, G, TG)
        ref = torch.tensor(loop_weights(scores, ids[t].tolist(), norm, 1.5), dtype=torch.float64)
        torch.testing.assert_close(weights[t].double(), ref, rtol=RTOL, atol=ATOL)


def test_sqrtsoftplus_bias_choice_differs_from_sigmoid():
    """Both score maps rise with the logit, so only the bias can tell them apart: sqrt-softplus scores
    spread wider for large logits, so a bias that lifts expert 2 over expert 0 under sigmoid does not
    under sqrt-softplus."""
    logits = torch.tensor([[6.0, -6.0, 2.0, -6.0]])
    bias = torch.tensor([0.0, 0.0, 0.2, 0.0])
    # sigmoid: s0 = 0.998, s2 + 0.2 = 1.081; sqrt-softplus: s0 = 2.450, s2 + 0.2 = 1.658
    _, sig = call("moe_route", logits, 1, "sigmoid", bias)
    _, ssp = call("moe_route", logits, 1, "sqrtsoftplus", bias)
    assert sig.tolist() == [[2]] and ssp.tolist() == [[0]]


# ---------------------------------------------------------------- hash routing

@pytest.mark.parametrize("kind", ["sqrtsoftplus", "sigmoid"])
def test_fixed_ids_weights(kind):
    g = torch.Generator().manual_seed(3)
    T, E, k = 5, 8, 3
    logits = 2 * torch.randn(T, E, generator=g)
    fixed = torch.tensor([[0, 1, 2], [7, 7, 3], [5, 5, 5], [4, 0, 6], [1, 6, 1]], dtype=torch.int32)
    bias = torch.randn(E, generator=g)  # steers selection only, and there is none to steer
    score = sqrt_softplus if kind == "sqrtsoftplus" else (lambda v: 1.0 / (1.0 + math.exp(-v)))
    for norm in (True, False):
        weights, ids = call("moe_route", logits, k, kind, bias, norm_topk_prob=norm, routed_scaling_factor=2.5,
                            fixed_ids=fixed)
        assert ids.dtype == torch.int64 and torch.equal(ids, fixed.long())
        for t in range(T):
            scores = [score(v) for v in logits[t].tolist()]
            ref = torch.tensor(loop_weights(scores, fixed[t].tolist(), norm, 2.5), dtype=torch.float64)
            torch.testing.assert_close(weights[t].double(), ref, rtol=RTOL, atol=ATOL)
    # a token whose k slots name one expert gives each slot 1/k of the scaling factor
    weights, _ = call("moe_route", logits, k, kind, fixed_ids=fixed)
    torch.testing.assert_close(weights[2], torch.full((k,), 1 / k))


def test_fixed_ids_no_tokens():
    none = torch.zeros(0, 2, dtype=torch.long)
    weights, ids = call("moe_route", torch.zeros(0, 8), 2, "sqrtsoftplus", fixed_ids=none)
    assert weights.shape == ids.shape == (0, 2)


def test_fixed_ids_validation():
    logits = torch.randn(4, 8)
    ok = torch.zeros(4, 2, dtype=torch.long)
    wrong_shape = [torch.zeros(s, dtype=torch.long) for s in ((4, 3), (3, 2), (4,))]
    for bad in (*wrong_shape, torch.full((4, 2), 8), torch.full((4, 2), -1)):
        with pytest.raises(ValueError, match="fixed_ids"):
            call("moe_route", logits, 2, "sqrtsoftplus", fixed_ids=bad)
    for kind in ("softmax", "softmax_topk"):
        with pytest.raises(ValueError, match="hash routing"):
            call("moe_route", logits, 2, kind, fixed_ids=ok)
    call("moe_route", logits, 2, "sqrtsoftplus", fixed_ids=torch.full((4, 2), 7))  # the last expert is valid


# ---------------------------------------------------------------- clamped dense MLP

def loop_mlp(x, w1, w2, limit):
    """y = w2 · (SiLU(min(g, limit)) · clamp(u, ±limit)) with [g; u] = w1 · x, row by row in float64."""
    I = w2.shape[1]
    x, w1, w2 = x.double(), w1.double(), w2.double()
    out = torch.zeros(x.shape[0], w2.shape[0], dtype=torch.float64)
    for t in range(x.shape[0]):
        h = (w1 @ x[t]).tolist()
        a = []
        for i in range(I):
            g, u = h[i], h[I + i]
            if limit is not None:
                g, u = min(g, limit), max(-limit, min(u, limit))
            a.append(g / (1.0 + math.exp(-g)) * u)
        out[t] = w2 @ torch.tensor(a, dtype=torch.float64)
    return out


MLP_CASES = [(7, 12, 10), (1, 8, 16), (0, 6, 4)]  # (T, D, I): I != D so a transposed weight cannot pass


@pytest.mark.parametrize("limit", [None, 1.0, 4.0], ids=["nolimit", "limit1", "limit4"])
@pytest.mark.parametrize("T,D,I", MLP_CASES, ids=[f"T{T}-D{D}-I{I}" for T, D, I in MLP_CASES])
def test_dense_mlp_limit_matches_loop(T, D, I, limit):
    g = torch.Generator().manual_seed(T + D + I)
    x = 3 * torch.randn(T, D, generator=g)  # pre-activations of a few units: most cross ±1, some cross ±4
    w1 = torch.randn(2 * I, D, generator=g) / D**0.5
    w2 = torch.randn(D, I, generator=g) / I**0.5
    out = call("mlp", x, w1, w2, "silu", limit)
    assert out.shape == (T, D) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), loop_mlp(x, w1, w2, limit), rtol=RTOL, atol=ATOL)


def test_dense_mlp_limit_is_active():
    """The inputs reach every clamp branch (gate above, up above and below the limit, gate far below -limit),
    and clamping changes the output."""
    g = torch.Generator().manual_seed(17)
    x = 3 * torch.randn(7, 12, generator=g)
    w1 = torch.randn(20, 12, generator=g) / 12**0.5
    w2 = torch.randn(12, 10, generator=g) / 10**0.5
    h = x @ w1.t()
    gate, up = h[:, :10], h[:, 10:]
    assert (gate > 1).any() and (gate < -1).any() and (up > 1).any() and (up < -1).any()
    assert not torch.allclose(call("mlp", x, w1, w2, "silu", 1.0), call("mlp", x, w1, w2, "silu"))
    # a limit above every pre-activation changes nothing
    torch.testing.assert_close(call("mlp", x, w1, w2, "silu", float(h.abs().max()) + 1), call("mlp", x, w1, w2, "silu"))


def test_dense_mlp_limit_needs_silu():
    x, w1, w2 = torch.randn(2, 4), torch.randn(6, 4), torch.randn(4, 6)
    with pytest.raises(ValueError, match="silu"):
        call("mlp", x, w1, w2, "relu2", 1.0)
