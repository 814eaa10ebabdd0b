"""The op options gpt-oss runs on, against loops written from ARCHITECTURE.md 3 and 4 in the checkpoint's
own layout: ``softmax_topk`` routing, the clamped ``swiglu_oai`` activation, and biased experts whose
weights go through the loader's transforms (transposed, gate/up interleaved -> our [gate; up] rows)."""
import pytest
import torch

from dayzero.loader.rules import as_out_in, chain, deinterleave_last, deinterleave_rows
from dayzero.ops import call
from dayzero.ops.activation.reference import swiglu_oai
from dayzero.ops.moe.reference import grouped_experts, route

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # max|out - ref| / max|ref|
ALPHA, LIMIT = 1.702, 7.0


def assert_close_rel(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype and not torch.isnan(out).any()
    if ref.numel():
        err = (out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)
        assert err <= TOL[dtype], f"max rel err {float(err):.3g}"


def oai_interleaved(h):
    """gpt-oss SwiGLU on the checkpoint's interleaved channels (even = gate, odd = up), fp64."""
    gate, up = h[..., 0::2].clamp(max=LIMIT), h[..., 1::2].clamp(-LIMIT, LIMIT)
    return gate * torch.sigmoid(ALPHA * gate) * (up + 1)


# ---------------------------------------------------------------- routing

ROUTE_CASES = [(9, 6, 2), (1, 32, 4), (17, 8, 8), (0, 4, 2)]  # (T, E, k)


@pytest.mark.parametrize("T,E,k", ROUTE_CASES, ids=[f"T{T}-E{E}-k{k}" for T, E, k in ROUTE_CASES])
def test_softmax_topk_matches_loop(T, E, k):
    g = torch.Generator().manual_seed(T + E)
    logits = torch.randn(T, E, generator=g) * 3
    weights, ids = call("moe_route", logits, k, "softmax_topk")
    assert weights.shape == ids.shape == (T, k) and weights.dtype == torch.float32
    for t in range(T):
        chosen = sorted(range(E), key=lambda e: -float(logits[t, e]))[:k]
        assert set(ids[t].tolist()) == set(chosen)
        z = logits[t, ids[t]].double()
        torch.testing.assert_close(weights[t].double(), z.exp() / z.exp().sum(), rtol=1e-6, atol=1e-7)
    # the same weights as softmax over all experts renormalised over the chosen k
    w2, ids2 = route(logits, k, "softmax", norm_topk_prob=True)
    torch.testing.assert_close(weights, w2)
    assert torch.equal(ids, ids2)


def test_softmax_topk_rejects_bias_and_groups():
    with pytest.raises(ValueError, match="softmax_topk"):
        route(torch.randn(3, 8), 2, "softmax_topk", correction_bias=torch.zeros(8))
    with pytest.raises(ValueError, match="softmax_topk"):
        route(torch.randn(3, 8), 2, "softmax_topk", n_group=2)


# ---------------------------------------------------------------- activation

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_oai_matches_interleaved_definition(dtype):
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(11, 2 * 24, generator=g) * 6).to(dtype)  # wide enough that both clamps bite
    assert (h[:, 0::2] > LIMIT).any() and (h[:, 1::2].abs() > LIMIT).any()
    out = call("swiglu_oai", deinterleave_last(h))  # our layout: [gate | up]
    assert_close_rel(out, oai_interleaved(h.double()), dtype)


def test_swiglu_oai_clamps():
    gate = torch.tensor([-20.0, 0.5, 7.0, 50.0])
    up = torch.tensor([-50.0, 0.3, 9.0, 2.0])
    out = swiglu_oai(torch.cat((gate, up)).view(1, 8))[0]
    g = gate.clamp(max=LIMIT)
    u = up.clamp(-LIMIT, LIMIT)
    torch.testing.assert_close(out, g * torch.sigmoid(ALPHA * g) * (u + 1))
    assert out[3] == pytest.approx(7.0 * torch.sigmoid(torch.tensor(ALPHA * 7.0)).item() * 3.0)


# ---------------------------------------------------------------- biased experts, checkpoint layout

def loop_oai_experts(x, ids, weights, gate_up, gate_up_bias, down, down_bias):
    """Per token and chosen expert, fp64, in transformers' layout: gate_up [E, D, 2I] and its bias
    interleaved, down [E, I, D]."""
    x, gate_up, gate_up_bias, down, down_bias = (t.double() for t in (x, gate_up, gate_up_bias, down, down_bias))
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t] @ gate_up[e] + gate_up_bias[e]
            y[t] += float(weights[t, j]) * (oai_interleaved(h) @ down[e] + down_bias[e])
    return y


EXPERT_CASES = [(13, 6, 2, 24, 40), (1, 4, 4, 16, 12), (0, 4, 2, 8, 6), (29, 8, 3, 20, 10)]  # (T, E, k, D, I)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,k,D,inter", EXPERT_CASES, ids=[f"T{T}-E{E}-k{k}-D{D}-I{i}" for T, E, k, D, i in EXPERT_CASES])
def test_biased_oai_experts_match_checkpoint_layout(T, E, k, D, inter, dtype):
    g = torch.Generator().manual_seed(T * E + D)
    x = torch.randn(T, D, generator=g).to(dtype)
    gate_up = (torch.randn(E, D, 2 * inter, generator=g) * 2 / D**0.5).to(dtype)
    gate_up_bias = (torch.randn(E, 2 * inter, generator=g) * 4).to(dtype)  # pushes channels past the clamp
    down = (torch.randn(E, inter, D, generator=g) / inter**0.5).to(dtype)
    down_bias = torch.randn(E, D, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    weights, ids = route(logits, k, "softmax_topk")

    w1 = chain(as_out_in(2 * inter, D), deinterleave_rows)(gate_up)  # [E, 2I, D] as [gate; up]
    w2 = as_out_in(D, inter)(down)  # [E, D, I]
    out = grouped_experts(x, ids, weights, w1, w2, "swiglu_oai", deinterleave_last(gate_up_bias), down_bias)
    assert_close_rel(out, loop_oai_experts(x, ids, weights, gate_up, gate_up_bias, down, down_bias), dtype)


def test_as_out_in_orientations():
    t = torch.randn(3, 5, 8)
    assert torch.equal(as_out_in(5, 8)(t), t)  # already [out, in]
    assert torch.equal(as_out_in(8, 5)(t), t.transpose(1, 2))  # stored [in, out]
    sq = torch.randn(2, 4, 4)
    assert torch.equal(as_out_in(4, 4)(sq), sq.transpose(1, 2))  # square: read as transformers writes it
