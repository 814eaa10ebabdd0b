"""KDA reference ops: chunk form vs recurrent form vs an explicit per-token matrix loop (fp64),
state carried across calls, the short causal conv, the forget gate, and bf16 inputs.

Math: ARCHITECTURE.md section 1 (KDA).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops import call, registered
from dayzero.ops.kda.reference import causal_conv1d, kda_chunk, kda_gate, kda_recurrent
from tests.ops.varlen import RTOL, assert_close, cu, split





def make_inputs(lengths, H, K, V, seed=0, lower_bound=None, gate_scale=1.0):
    """Random KDA inputs with realistic gates: A_log ~ log U(1, 16), dt_bias = softplus^-1(dt),
    dt log-uniform in [1e-3, 0.1] (Kimi-Linear's init), f ~ N(0, gate_scale^2)."""
    gen = torch.Generator().manual_seed(seed)
    T, N = sum(lengths), len(lengths)
    q = torch.randn(T, H, K, generator=gen)
    k = torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, H, V, generator=gen)
    f = gate_scale * torch.randn(T, H, K, generator=gen)
    A_log = torch.empty(H).uniform_(1, 16, generator=gen).log()
    dt = torch.exp(torch.empty(H * K).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    g = kda_gate(f, A_log, dt_bias, lower_bound=lower_bound)
    beta = torch.sigmoid(torch.randn(T, H, generator=gen))
    S0 = 0.5 * torch.randn(N, H, K, V, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, initial_state=S0, cu_seqlens=cu(lengths))


def naive_kda(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm=True):
    """The recurrence written as matrices, one sequence, head and token at a time, in fp64:
    S_t = (I - b k k^T) Diag(e^g) S_{t-1} + b k v^T, o_t = S_t^T q_t."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q ** 2).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + 1e-6)
    T, H, K = q.shape
    o = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    states = initial_state.double().clone()
    eye = torch.eye(K, dtype=torch.float64)
    b = cu_seqlens.tolist()
    for i in range(len(b) - 1):
        for h in range(H):
            S = states[i, h]
            for t in range(b[i], b[i + 1]):
                kt = k[t, h][:, None]  # column vector [K, 1]
                S = (eye - beta[t, h] * kt @ kt.T) @ torch.diag(g[t, h].exp()) @ S + beta[t, h] * kt @ v[t, h][None]
                o[t, h] = S.T @ (scale * q[t, h])
            states[i, h] = S
    return o, states


# ---------------------------------------------------------------- chunk vs recurrent

CHUNK_CASES = [  # (lengths, H, K, V, chunk_size, lower_bound)
    *[((T,), 2, 16, 8, C, None) for T in (1, 63, 64, 65, 130) for C in (16, 64)],
    ((65,), 2, 16, 8, 16, -5.0),
    ((130,), 2, 16, 8, 64, -5.0),
    ((5, 0, 64, 17, 130), 2, 16, 8, 16, None),
    ((5, 0, 64, 17, 130), 3, 8, 16, 64, -5.0),
    ((0,), 1, 8, 8, 16, None),
    ((), 1, 8, 8, 16, None),
]


def case_id(c):
    lengths, H, K, V, C, lb = c
    return f"T{'+'.join(map(str, lengths)) or 'none'}-H{H}-K{K}-V{V}-C{C}" + ("-lb" if lb is not None else "")


@pytest.mark.parametrize("case", CHUNK_CASES, ids=case_id)
def test_chunk_matches_recurrent(case):
    lengths, H, K, V, C, lb = case
    inp = make_inputs(lengths, H, K, V, seed=len(lengths) + sum(lengths), lower_bound=lb)
    o_r, S_r = kda_recurrent(**inp)
    o_c, S_c = kda_chunk(**inp, chunk_size=C)
    assert o_c.dtype == torch.float32 and S_c.dtype == torch.float32
    assert_close(o_c, o_r, RTOL[torch.float32], "o")
    assert_close(S_c, S_r, RTOL[torch.float32], "final state")
    for n, (s, e) in enumerate(zip(inp["cu_seqlens"][:-1], inp["cu_seqlens"][1:])):
        if s == e:  # an empty sequence passes its state through unchanged
            assert torch.equal(S_c[n], inp["initial_state"][n])


@pytest.mark.parametrize("C", [16, 64])
def test_chunk_strong_decay_stays_finite(C):
    # g = -20 per channel and token: Γ reaches -1280 in a chunk, so e^{-Γ} alone would overflow
    inp = make_inputs((150, 3), 2, 16, 8, seed=3)
    inp["g"] = torch.full_like(inp["g"], -20.0)
    o_r, S_r = kda_recurrent(**inp)
    o_c, S_c = kda_chunk(**inp, chunk_size=C)
    assert_close(o_c, o_r, RTOL[torch.float32], "o")
    assert_close(S_c, S_r, RTOL[torch.float32], "final state")


def test_chunk_matches_recurrent_without_l2norm():
    inp = make_inputs((40, 23), 2, 16, 8, seed=4)
    inp["k"] = F.normalize(inp["k"], dim=-1)  # keep I - b k k^T contractive without the in-op norm
    o_r, S_r = kda_recurrent(**inp, use_qk_l2norm=False)
    o_c, S_c = kda_chunk(**inp, use_qk_l2norm=False, chunk_size=16)
    o_n, S_n = naive_kda(**inp, use_qk_l2norm=False)
    assert_close(o_r, o_n, RTOL[torch.float32], "recurrent o")
    assert_close(o_c, o_n, RTOL[torch.float32], "chunk o")
    assert_close(S_c, S_n, RTOL[torch.float32], "chunk state")


# ---------------------------------------------------------------- recurrent vs explicit loop

@pytest.mark.parametrize("lengths", [(1, 1, 1, 1), (7, 7, 7), (5, 0, 19, 1), (33,)],
                         ids=lambda ls: "T" + "+".join(map(str, ls)))
@pytest.mark.parametrize("lb", [None, -5.0], ids=["softplus", "lb"])
def test_recurrent_matches_explicit_loop(lengths, lb):
    inp = make_inputs(lengths, 2, 8, 4, seed=sum(lengths), lower_bound=lb)
    o, S = kda_recurrent(**inp)
    o_n, S_n = naive_kda(**inp)
    assert_close(o, o_n, RTOL[torch.float32], "o")
    assert_close(S, S_n, RTOL[torch.float32], "final state")


def test_recurrent_zero_initial_state_and_inputs_untouched():
    inp = make_inputs((6, 9), 2, 8, 4, seed=5)
    saved = {n: x.clone() for n, x in inp.items() if isinstance(x, torch.Tensor)}
    o, S = kda_recurrent(**{**inp, "initial_state": None})
    o_n, S_n = naive_kda(**{**inp, "initial_state": torch.zeros_like(inp["initial_state"])})
    assert_close(o, o_n, RTOL[torch.float32], "o")
    assert_close(S, S_n, RTOL[torch.float32], "final state")
    for fn in (kda_recurrent, kda_chunk):
        _, S = fn(**{**inp, "cu_seqlens": cu((0, 0)), "q": inp["q"][:0], "k": inp["k"][:0],
                     "v": inp["v"][:0], "g": inp["g"][:0], "beta": inp["beta"][:0]})
        assert torch.equal(S, inp["initial_state"]) and S.data_ptr() != inp["initial_state"].data_ptr()
    for n, x in saved.items():
        assert torch.equal(inp[n], x), f"{n} was modified"


# ---------------------------------------------------------------- state carried across calls


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("lengths,first", [((40, 0, 70), (17, 0, 64)), ((9, 30), (9, 1)), ((20,), (0,))],
                         ids=["T40+0+70", "T9+30", "T20-empty-first"])
def test_split_calls_equal_one_call(form, lengths, first):
    fn = kda_recurrent if form == "recurrent" else lambda **kw: kda_chunk(**kw, chunk_size=16)
    inp = make_inputs(lengths, 2, 16, 8, seed=6)
    o, S = fn(**inp)
    a, c, rows1, rows2 = split(inp, first, ("q", "k", "v", "g", "beta"))
    o1, S1 = fn(**a)
    o2, S2 = fn(**{**c, "initial_state": S1})
    o_split = torch.empty_like(o)
    o_split[rows1], o_split[rows2] = o1, o2
    assert_close(o_split, o, RTOL[torch.float32], "o")
    assert_close(S2, S, RTOL[torch.float32], "final state")


def test_prefill_then_decode_steps():
    # the engine's pattern: chunk prefill, then recurrent decode one token per sequence
    lengths = (21, 35, 8)
    inp = make_inputs([n + 3 for n in lengths], 2, 16, 8, seed=7)
    o, S = kda_recurrent(**inp)
    a, rest, rows1, _ = split(inp, lengths, ("q", "k", "v", "g", "beta"))
    o_p, state = kda_chunk(**a, chunk_size=16)
    outs = {r: o_p[i] for i, r in enumerate(rows1)}
    b = inp["cu_seqlens"].tolist()
    for step in range(3):
        rows = [b[i] + lengths[i] + step for i in range(len(lengths))]
        o_d, state = kda_recurrent(**{**inp, **{n: inp[n][rows] for n in ("q", "k", "v", "g", "beta")},
                                      "initial_state": state, "cu_seqlens": cu([1] * len(lengths))})
        outs.update({r: o_d[i] for i, r in enumerate(rows)})
    assert_close(torch.stack([outs[r] for r in range(o.shape[0])]), o, RTOL[torch.float32], "o")
    assert_close(state, S, RTOL[torch.float32], "final state")


# ---------------------------------------------------------------- causal conv

def _conv_inputs(T, C=6, W=4, N=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(T, C, generator=gen), torch.randn(C, W, generator=gen), torch.randn(N, C, W - 1, generator=gen)


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_fresh_sequence_matches_torch_conv1d(W, activation):
    x, w, _ = _conv_inputs(11, W=W)
    # a second sequence: per-sequence zero padding must not leak tokens across the boundary
    x2 = torch.randn(5, x.shape[1])
    state = torch.zeros(2, x.shape[1], W - 1)
    y, new_state = causal_conv1d(torch.cat([x, x2]), w, state, cu((11, 5)), activation=activation)
    for xi, yi in ((x, y[:11]), (x2, y[11:])):
        ref = F.conv1d(F.pad(xi.T[None], (W - 1, 0)), w[:, None, :], groups=xi.shape[1])[0].T
        ref = F.silu(ref) if activation == "silu" else ref
        assert_close(yi, ref, 1e-6, "y")
    assert torch.equal(new_state[0], x[11 - (W - 1):].T) and torch.equal(new_state[1], x2[5 - (W - 1):].T)


@pytest.mark.parametrize("splits", [(4, 7), (1, 1, 1, 8), (2, 0, 9), (11,)], ids=lambda s: "+".join(map(str, s)))
def test_conv_split_calls_equal_one_call(splits):
    x, w, state = _conv_inputs(11, N=1, seed=1)
    y, final = causal_conv1d(x, w, state, cu((11,)))
    ys, s = [], state
    for part in torch.split(x, list(splits)):
        y_i, s = causal_conv1d(part, w, s, cu((part.shape[0],)))
        ys.append(y_i)
    assert_close(torch.cat(ys), y, 1e-6, "y")
    assert torch.equal(s, final)


def test_conv_short_call_shifts_window_and_does_not_mutate():
    x, w, state = _conv_inputs(3, C=5, W=4, N=3, seed=2)
    x_saved, state_saved = x.clone(), state.clone()
    # sequence 0 gets 1 token, sequence 1 none, sequence 2 two tokens
    y, new = causal_conv1d(x, w, state, cu((1, 0, 2)))
    assert torch.equal(new[0], torch.cat([state[0, :, 1:], x[0:1].T], 1))
    assert torch.equal(new[1], state[1])
    assert torch.equal(new[2], torch.cat([state[2, :, 2:], x[1:3].T], 1))
    u0 = torch.cat([state[0], x[0:1].T], 1)  # [C, W]
    assert_close(y[0], F.silu((u0 * w).sum(1)), 1e-6, "y")
    assert torch.equal(x, x_saved) and torch.equal(state, state_saved)
    assert new.data_ptr() != state.data_ptr()


def test_conv_decode_batch_equals_per_sequence():
    # equal lengths take the batched path; it must equal per-sequence calls
    x, w, state = _conv_inputs(3, C=5, W=4, N=3, seed=3)
    y, new = causal_conv1d(x, w, state, cu((1, 1, 1)))
    for i in range(3):
        y_i, s_i = causal_conv1d(x[i:i + 1], w, state[i:i + 1], cu((1,)))
        assert_close(y[i:i + 1], y_i, 1e-6, "y")
        assert torch.equal(new[i:i + 1], s_i)


# ---------------------------------------------------------------- gate

@pytest.mark.parametrize("lower_bound", [None, -5.0, -1.0])
def test_gate_formulas_and_sign(lower_bound):
    T, H, K = 7, 3, 4
    gen = torch.Generator().manual_seed(8)
    f = 10 * torch.randn(T, H, K, generator=gen)  # wide range: softplus' linear branch too
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f.bfloat16(), A_log, dt_bias, lower_bound=lower_bound)
    assert g.dtype == torch.float32 and g.shape == (T, H, K)
    ref = torch.empty(T, H, K, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            for c in range(K):
                x = float(f.bfloat16()[t, h, c]) + float(dt_bias[h * K + c])  # head-major dt_bias
                a = math.exp(float(A_log[h]))
                if lower_bound is None:
                    ref[t, h, c] = -a * (max(x, 0) + math.log1p(math.exp(-abs(x))))
                else:
                    ref[t, h, c] = lower_bound * 0.5 * (1 + math.tanh(a * x / 2))  # sigmoid, no overflow
    assert_close(g, ref, 1e-6, "g")
    assert (g <= 0).all()
    if lower_bound is not None:
        assert (g >= lower_bound).all()
    # vLLM stores A_log as [1, 1, H, 1]
    assert torch.equal(kda_gate(f.bfloat16(), A_log.view(1, 1, H, 1), dt_bias, lower_bound), g)


# ---------------------------------------------------------------- bf16 and registry

@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_bf16_inputs_within_tolerance(form):
    fn = kda_recurrent if form == "recurrent" else lambda **kw: kda_chunk(**kw, chunk_size=16)
    inp = make_inputs((37, 0, 64), 2, 16, 8, seed=9)
    o32, S32 = fn(**inp)
    low = {**inp, **{n: inp[n].bfloat16() for n in ("q", "k", "v", "beta")}}
    o16, S16 = fn(**low)
    assert o16.dtype == torch.bfloat16 and S16.dtype == torch.float32
    assert_close(o16, o32, RTOL[torch.bfloat16], "o")
    assert_close(S16, S32, RTOL[torch.bfloat16], "final state")


def test_bf16_conv():
    x, w, state = _conv_inputs(9, N=2, seed=10)
    y32, s32 = causal_conv1d(x, w, state, cu((4, 5)))
    y16, s16 = causal_conv1d(x.bfloat16(), w, state.bfloat16(), cu((4, 5)))
    assert y16.dtype == torch.bfloat16 and s16.dtype == torch.bfloat16
    assert_close(y16, y32, RTOL[torch.bfloat16], "y")
    assert_close(s16, s32, RTOL[torch.bfloat16], "state")


def test_registered_and_callable():
    for op in ("kda_gate", "causal_conv1d", "kda_recurrent", "kda_chunk"):
        assert "reference" in registered()[op].impls
    inp = make_inputs((5, 3), 1, 8, 4, seed=11)
    o, S = call("kda_chunk", **inp)  # device taken from the first tensor
    o_r, S_r = kda_recurrent(**inp)
    assert_close(o, o_r, RTOL[torch.float32], "o")
