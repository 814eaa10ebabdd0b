"""MoE reference ops against loops and brute force written from ARCHITECTURE section 3."""
from itertools import combinations

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops import call, registered
from dayzero.ops.moe.reference import dense_mlp, grouped_experts, route

# max relative error (max|out - ref| / max|ref|) allowed, per output dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_close_rel(out, ref, dtype):
    """Both max-abs (scaled by the reference's size) and max-relative-error checks."""
    assert out.shape == ref.shape and out.dtype == dtype
    if ref.numel() == 0:
        return
    err = (out.double() - ref.double()).abs()
    scale = ref.double().abs().max().clamp_min(1e-30)
    assert not torch.isnan(out).any()
    assert err.max() / scale <= TOL[dtype], f"max rel err {float(err.max() / scale):.3g}"
    torch.testing.assert_close(out.double(), ref.double(), rtol=10 * TOL[dtype], atol=TOL[dtype] * float(scale))


def test_registered():
    for op in ("moe_route", "moe_permute", "moe_experts_grouped", "moe_unpermute", "moe_experts", "mlp"):
        assert op in registered()


# ---------------------------------------------------------------- grouped experts

def loop_experts(x, ids, weights, w1, w2, activation):
    """Per token, per chosen expert, in fp64: the definition of the routed MoE sum."""
    x, w1, w2, weights = x.double(), w1.double(), w2.double(), weights.double()
    inter = w2.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e] @ x[t]
            if activation == "silu":
                a = F.silu(h[:inter]) * h[inter:]  # rows 0..I-1 gate, I..2I-1 up
            else:
                a = torch.relu(h) ** 2
            y[t] += weights[t, j] * (w2[e] @ a)
    return y


def make_experts(T, E, k, D, inter, activation, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * inter if activation == "silu" else inter
    x = torch.randn(T, D, generator=g).to(dtype)
    w1 = (torch.randn(E, rows, D, generator=g) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=g) / inter**0.5).to(dtype)
    # only even experts receive tokens, so the odd ones have empty segments
    used = torch.arange(0, E, 2)
    ids = torch.stack([used[torch.randperm(len(used), generator=g)[:k]] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)
    weights = torch.rand(T, k, generator=g) + 0.1
    return x, ids, weights, w1, w2


EXPERT_CASES = [  # (T, E, k, D, I): I != D everywhere so a transposed weight cannot pass
    (13, 16, 4, 24, 40),
    (37, 9, 3, 11, 5),
    (1, 8, 2, 16, 12),
    (0, 4, 2, 8, 6),
]


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T,E,k,D,inter", EXPERT_CASES,
                         ids=[f"T{T}-E{E}-k{k}-D{D}-I{i}" for T, E, k, D, i in EXPERT_CASES])
def test_grouped_experts_matches_loop(T, E, k, D, inter, activation):
    x, ids, weights, w1, w2 = make_experts(T, E, k, D, inter, activation, torch.float32, seed=T + E)
    out = grouped_experts(x, ids, weights, w1, w2, activation=activation)
    assert_close_rel(out, loop_experts(x, ids, weights, w1, w2, activation), torch.float32)
    if T:
        assert set(range(1, E, 2)).isdisjoint(ids.flatten().tolist())  # empty experts exist


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_grouped_experts_bf16(activation):
    x, ids, weights, w1, w2 = make_experts(13, 16, 4, 24, 40, activation, torch.bfloat16, seed=1)
    out = call("moe_experts", x, ids, weights, w1, w2, activation=activation)
    assert_close_rel(out, loop_experts(x, ids, weights, w1, w2, activation), torch.bfloat16)


def test_grouped_experts_repeated_expert_accumulates():
    # the same expert in two slots of one token must count twice
    x, _, _, w1, w2 = make_experts(3, 4, 2, 8, 6, "silu", torch.float32, seed=3)
    ids = torch.tensor([[1, 1], [0, 1], [3, 3]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [0.3, 0.7]])
    assert_close_rel(grouped_experts(x, ids, weights, w1, w2),
                     loop_experts(x, ids, weights, w1, w2, "silu"), torch.float32)


def test_grouped_experts_rejects_bad_shapes():
    x, ids, weights, w1, w2 = make_experts(5, 4, 2, 8, 6, "silu", torch.float32, seed=4)
    with pytest.raises(ValueError, match="activation"):
        grouped_experts(x, ids, weights, w1, w2, activation="relu2")  # w1 has 2I rows
    with pytest.raises(ValueError, match="expert ids"):
        grouped_experts(x, ids + 4, weights, w1, w2)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_dense_mlp_is_one_expert(T, activation):
    x, _, _, w1, w2 = make_experts(T, 1, 1, 10, 14, activation, torch.float32, seed=5)
    ids = torch.zeros(T, 1, dtype=torch.long)
    ones = torch.ones(T, 1)
    dense = call("mlp", x, w1[0], w2[0], activation=activation)
    torch.testing.assert_close(dense, grouped_experts(x, ids, ones, w1, w2, activation), rtol=1e-6, atol=1e-6)
    assert_close_rel(dense, loop_experts(x, ids, ones, w1, w2, activation), torch.float32)


def test_dense_mlp_leading_dims_and_bf16():
    x, _, _, w1, w2 = make_experts(6, 1, 1, 10, 14, "silu", torch.bfloat16, seed=6)
    out = dense_mlp(x.view(2, 3, 10), w1[0], w2[0])
    ref = loop_experts(x, torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1), w1, w2, "silu")
    assert_close_rel(out.view(6, 10), ref, torch.bfloat16)


# ---------------------------------------------------------------- routing

def brute_force_choice(scores, k, bias, n_group, topk_group):
    """ARCHITECTURE 3.1 steps 1-4 for one token, by enumeration, on any scores: keep the topk_group groups
    whose top-2 sums of s + bias are highest, then the k experts of those groups with the highest s + bias."""
    sel = [float(v) + (0.0 if bias is None else float(bias[e])) for e, v in enumerate(scores)]
    size = len(sel) // n_group
    groups = [list(range(j * size, (j + 1) * size)) for j in range(n_group)]
    allowed = list(range(len(sel)))
    if n_group > 1:
        group_score = [sum(sorted((sel[e] for e in grp), reverse=True)[:2]) for grp in groups]
        best = max(combinations(range(n_group), topk_group), key=lambda c: sum(group_score[j] for j in c))
        allowed = [e for j in best for e in groups[j]]
    return set(max(combinations(allowed, k), key=lambda c: sum(sel[e] for e in c)))


def brute_force_sigmoid(logits, k, bias, n_group, topk_group):
    return brute_force_choice(torch.sigmoid(logits.double()).tolist(), k, bias, n_group, topk_group)


def sigmoid_weights(logits, ids, norm, scale):
    s = torch.sigmoid(logits.double()).gather(1, ids)
    if norm:
        s = s / (s.sum(-1, keepdim=True) + 1e-20)
    return s * scale


ROUTE_CASES = [  # (T, E, k, n_group, topk_group)
    (13, 16, 4, 4, 2),
    (7, 24, 5, 6, 3),
    (5, 12, 3, 1, 1),
    (1, 32, 8, 8, 4),
    (9, 15, 2, 5, 1),
]


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("T,E,k,G,TG", ROUTE_CASES,
                         ids=[f"T{T}-E{E}-k{k}-G{G}-TG{tg}" for T, E, k, G, tg in ROUTE_CASES])
def test_sigmoid_route_matches_brute_force(T, E, k, G, TG, with_bias):
    g = torch.Generator().manual_seed(T * E + k)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None
    weights, ids = route(logits, k, "sigmoid", bias, n_group=G, topk_group=TG, routed_scaling_factor=2.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, k)
    for t in range(T):
        assert set(ids[t].tolist()) == brute_force_sigmoid(logits[t], k, bias, G, TG)
    torch.testing.assert_close(weights.double(), sigmoid_weights(logits, ids, True, 2.5), rtol=1e-6, atol=1e-7)


def designed_logits():
    """E=16 in 4 groups of 4, keep 2 groups, k=4.

    token 0: expert 0 has the highest score, but its group (one star, three weak members) has a
             lower top-2 sum than groups 1 and 2, whose members are all moderately high.
    token 1: groups 2 and 3 win; expert 9 (group 2) has a low score, and only the bias on it
             lifts it into the top-k, displacing expert 10.
    """
    logits = torch.full((2, 16), -4.0)
    logits[0, 0] = 6.0                                   # star in losing group 0
    logits[0, 4:8] = torch.tensor([1.0, 0.9, 0.8, 0.7])  # group 1
    logits[0, 8:12] = torch.tensor([1.1, 0.6, 0.5, 0.4])  # group 2
    logits[1, 8:12] = torch.tensor([2.0, -3.0, 1.5, 1.4])  # group 2
    logits[1, 12:16] = torch.tensor([1.9, 1.8, 1.2, 0.3])  # group 3
    bias = torch.zeros(16)
    bias[9] = 3.0  # sigma(-3)+3 outranks every unbiased score, and keeps group 2 winning
    return logits, bias


def test_group_limit_drops_star_expert_of_losing_group():
    logits, bias = designed_logits()
    _, ids_flat = route(logits, 4, "sigmoid", n_group=1, topk_group=1)
    assert 0 in ids_flat[0].tolist()  # without groups the star is chosen ...
    _, ids = route(logits, 4, "sigmoid", n_group=4, topk_group=2)
    assert 0 not in ids[0].tolist()  # ... with groups it is not
    assert set(ids[0].tolist()) == brute_force_sigmoid(logits[0], 4, None, 4, 2) == {4, 5, 6, 8}


def test_bias_changes_choice_but_not_weights():
    logits, bias = designed_logits()
    w0, ids0 = route(logits, 4, "sigmoid", None, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w1, ids1 = route(logits, 4, "sigmoid", bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert set(ids0[1].tolist()) == {8, 10, 12, 13}
    assert set(ids1[1].tolist()) == brute_force_sigmoid(logits[1], 4, bias, 4, 2) == {8, 9, 12, 13}
    # the biased expert's weight reflects sigma(-3) only, normalised over the chosen set
    torch.testing.assert_close(w1.double(), sigmoid_weights(logits, ids1, True, 2.5), rtol=1e-6, atol=1e-7)
    j = ids1[1].tolist().index(9)
    s = torch.sigmoid(logits[1].double())
    expect = s[9] / (s[8] + s[9] + s[12] + s[13]) * 2.5
    assert abs(float(w1[1, j]) - float(expect)) < 1e-6
    assert float(w1[1, j]) < 0.1 < float(w1[1].max())


def test_sigmoid_without_normalisation():
    logits = torch.randn(6, 8, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    weights, ids = route(logits, 3, "sigmoid", n_group=2, topk_group=2, norm_topk_prob=False,
                         routed_scaling_factor=1.5)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights.double(), sigmoid_weights(logits.float(), ids, False, 1.5))


SOFTMAX_CASES = [(13, 16, 4), (1, 7, 3), (0, 8, 2), (21, 60, 8)]


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
@pytest.mark.parametrize("T,E,k", SOFTMAX_CASES, ids=[f"T{T}-E{E}-k{k}" for T, E, k in SOFTMAX_CASES])
def test_softmax_route(T, E, k, norm):
    logits = (torch.randn(T, E, generator=torch.Generator().manual_seed(E + k)) * 2).to(torch.bfloat16)
    weights, ids = route(logits, k, "softmax", norm_topk_prob=norm, routed_scaling_factor=1.25)
    assert weights.shape == ids.shape == (T, k) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    p = torch.softmax(logits.double(), dim=-1)
    for t in range(T):
        assert set(ids[t].tolist()) == set(torch.sort(p[t], descending=True).indices[:k].tolist())
    ref = p.gather(1, ids)
    if norm:
        ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.double(), ref * 1.25, rtol=1e-6, atol=1e-7)
    if norm and T:
        torch.testing.assert_close(weights.sum(-1), torch.full((T,), 1.25))


def test_route_validation():
    logits = torch.randn(3, 16)
    with pytest.raises(ValueError, match="n_group"):
        route(logits, 4, n_group=3)
    with pytest.raises(ValueError, match="topk_group"):
        route(logits, 4, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="top_k"):
        route(logits, 12, n_group=4, topk_group=2)  # only 8 experts survive the group limit
    with pytest.raises(ValueError, match="kind"):
        route(logits, 4, kind="tanh")
    with pytest.raises(ValueError, match="softmax"):
        route(logits, 4, kind="softmax", correction_bias=torch.zeros(16))
