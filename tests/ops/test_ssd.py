"""Mamba-2 SSD reference ops: chunk form and recurrent form vs the per-token recurrence written out here
(fp64), state carried across calls, the time step, and the gated grouped output norm."""
import math

import pytest
import torch
import torch.nn.functional as F

from dayzero.ops import call, registered
from dayzero.ops.ssd.reference import ssd_chunk, ssd_dt, ssd_gated_norm, ssd_recurrent
from tests.ops.varlen import RTOL, assert_close, cu, split

PER_TOKEN = ("x", "dt", "B", "C")




def make_inputs(lengths, H=4, P=8, N=16, G=2, seed=0):
    """Random SSD inputs with Nemotron-H-like time steps: A_log = log U(1, 16), dt_bias = softplus^-1 of a
    log-uniform dt in [1e-3, 0.1], raw dt ~ N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    T, S = sum(lengths), len(lengths)
    dt_init = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(0.1), generator=gen))
    dt_bias = dt_init + torch.log(-torch.expm1(-dt_init))
    A = -torch.empty(H).uniform_(1, 16, generator=gen)
    return dict(
        x=torch.randn(T, H, P, generator=gen), dt=ssd_dt(torch.randn(T, H, generator=gen), dt_bias), A=A,
        B=torch.randn(T, G, N, generator=gen), C=torch.randn(T, G, N, generator=gen),
        D=torch.randn(H, generator=gen), initial_state=torch.randn(S, H, P, N, generator=gen),
        cu_seqlens=cu(lengths),
    )


def naive_ssd(x, dt, A, B, C, D, initial_state, cu_seqlens):
    """The recurrence one sequence, head and token at a time, in fp64:
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,  y_t = S_t C_t + D_h x_t, head h reading group h // (H/G)."""
    x, dt, A, B, C = (t.double() for t in (x, dt, A, B, C))
    T, H, P = x.shape
    per_group = H // B.shape[1]
    y = torch.zeros(T, H, P, dtype=torch.float64)
    states = initial_state.double().clone()
    b = cu_seqlens.tolist()
    for i in range(len(b) - 1):
        for h in range(H):
            S, g = states[i, h], h // per_group
            for t in range(b[i], b[i + 1]):
                S = math.exp(dt[t, h] * A[h]) * S + dt[t, h] * torch.outer(x[t, h], B[t, g])
                y[t, h] = S @ C[t, g] + (0.0 if D is None else D[h].double() * x[t, h])
            states[i, h] = S
    return y, states


# ---------------------------------------------------------------- both forms vs the written-out recurrence

CASES = [  # (lengths, H, P, N, G, chunk)
    *[((T,), 4, 8, 16, 2, C) for T in (1, 15, 16, 17, 50) for C in (8, 16)],
    ((5, 0, 16, 23, 40), 4, 8, 16, 2, 16),
    ((5, 0, 16, 23, 40), 6, 4, 8, 3, 8),
    ((33, 2), 4, 8, 16, 1, 16),
    ((0,), 2, 4, 8, 1, 16),
    ((), 2, 4, 8, 1, 16),
]


def case_id(c):
    lengths, H, P, N, G, C = c
    return f"T{'+'.join(map(str, lengths)) or 'none'}-H{H}-P{P}-N{N}-G{G}-C{C}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_chunk_and_recurrent_match_per_token_recurrence(case):
    lengths, H, P, N, G, C = case
    inp = make_inputs(lengths, H, P, N, G, seed=len(lengths) + sum(lengths))
    y_n, S_n = naive_ssd(**inp)
    y_c, S_c = ssd_chunk(**inp, chunk_size=C)
    y_r, S_r = ssd_recurrent(**inp)
    for name, y, S in (("chunk", y_c, S_c), ("recurrent", y_r, S_r)):
        assert y.dtype == torch.float32 and S.dtype == torch.float32
        assert_close(y, y_n, RTOL[torch.float32], f"{name} y")
        assert_close(S, S_n, RTOL[torch.float32], f"{name} final state")
    for i, (s, e) in enumerate(zip(inp["cu_seqlens"][:-1], inp["cu_seqlens"][1:])):
        if s == e:  # an empty sequence passes its state through unchanged
            assert torch.equal(S_c[i], inp["initial_state"][i]) and torch.equal(S_r[i], inp["initial_state"][i])


@pytest.mark.parametrize("C", [8, 32])
def test_chunk_strong_decay_stays_finite(C):
    # dt·A = -200 per token: Λ reaches -6400 in a chunk, so e^{-Λ} alone would overflow
    inp = make_inputs((70, 3), seed=3)
    inp["dt"] = torch.full_like(inp["dt"], 20.0)
    inp["A"] = torch.full_like(inp["A"], -10.0)
    y_r, S_r = ssd_recurrent(**inp)
    y_c, S_c = ssd_chunk(**inp, chunk_size=C)
    assert_close(y_c, y_r, RTOL[torch.float32], "y")
    assert_close(S_c, S_r, RTOL[torch.float32], "final state")


def test_no_skip_zero_initial_state_and_inputs_untouched():
    inp = make_inputs((6, 19), seed=5)
    saved = {n: t.clone() for n, t in inp.items()}
    args = {**inp, "D": None, "initial_state": None}
    y_n, S_n = naive_ssd(**{**args, "initial_state": torch.zeros_like(inp["initial_state"])})
    for fn in (ssd_recurrent, lambda **kw: ssd_chunk(**kw, chunk_size=8)):
        y, S = fn(**args)
        assert_close(y, y_n, RTOL[torch.float32], "y")
        assert_close(S, S_n, RTOL[torch.float32], "final state")
        _, S = fn(**{**inp, **{n: inp[n][:0] for n in PER_TOKEN}, "cu_seqlens": cu((0, 0))})
        assert torch.equal(S, inp["initial_state"]) and S.data_ptr() != inp["initial_state"].data_ptr()
    for n, t in saved.items():
        assert torch.equal(inp[n], t), f"{n} was modified"


# ---------------------------------------------------------------- state carried across calls


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("lengths,first", [((40, 0, 70), (17, 0, 33)), ((9, 30), (9, 1)), ((20,), (0,))],
                         ids=["T40+0+70", "T9+30", "T20-empty-first"])
def test_split_calls_equal_one_call(form, lengths, first):
    fn = ssd_recurrent if form == "recurrent" else lambda **kw: ssd_chunk(**kw, chunk_size=16)
    inp = make_inputs(lengths, seed=6)
    y, S = fn(**inp)
    a, c, rows1, rows2 = split(inp, first, PER_TOKEN)
    y1, S1 = fn(**a)
    y2, S2 = fn(**{**c, "initial_state": S1})
    y_split = torch.empty_like(y)
    y_split[rows1], y_split[rows2] = y1, y2
    assert_close(y_split, y, RTOL[torch.float32], "y")
    assert_close(S2, S, RTOL[torch.float32], "final state")


def test_prefill_then_decode_steps():
    # the engine's pattern: chunk prefill, then recurrent decode one token per sequence
    lengths = (21, 35, 8)
    inp = make_inputs([n + 3 for n in lengths], seed=7)
    y, S = naive_ssd(**inp)
    a, _, rows1, _ = split(inp, lengths, PER_TOKEN)
    y_p, state = ssd_chunk(**a, chunk_size=16)
    outs = {r: y_p[i] for i, r in enumerate(rows1)}
    b = inp["cu_seqlens"].tolist()
    for step in range(3):
        rows = [b[i] + lengths[i] + step for i in range(len(lengths))]
        y_d, state = ssd_recurrent(**{**inp, **{n: inp[n][rows] for n in PER_TOKEN}, "initial_state": state,
                                      "cu_seqlens": cu([1] * len(lengths))})
        outs.update({r: y_d[i] for i, r in enumerate(rows)})
    assert_close(torch.stack([outs[r] for r in range(y.shape[0])]), y, RTOL[torch.float32], "y")
    assert_close(state, S, RTOL[torch.float32], "final state")


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_bf16_inputs_fp32_state(form):
    inp = make_inputs((12, 30), seed=8)
    fn = ssd_recurrent if form == "recurrent" else lambda **kw: ssd_chunk(**kw, chunk_size=16)
    y32, S32 = fn(**inp)
    y16, S16 = fn(**{**inp, "x": inp["x"].bfloat16(), "B": inp["B"].bfloat16(), "C": inp["C"].bfloat16()})
    assert y16.dtype == torch.bfloat16 and S16.dtype == torch.float32
    assert_close(y16, y32, RTOL[torch.bfloat16], "y")
    assert_close(S16, S32, RTOL[torch.bfloat16], "final state")


# ---------------------------------------------------------------- time step and output norm

def test_dt_softplus_bias_and_limits():
    dt, bias = torch.tensor([[-30.0, 0.0], [2.0, 40.0]]), torch.tensor([0.5, -1.0])
    expect = torch.log1p(torch.exp(dt.double() + bias.double()))
    assert_close(ssd_dt(dt, bias), expect, 1e-6, "no limit")
    assert ssd_dt(dt, bias).dtype == torch.float32
    torch.testing.assert_close(ssd_dt(dt, bias, (1e-3, 5.0)), expect.clamp(1e-3, 5.0).float())


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_gated_norm_per_group_gate_first(groups):
    gen = torch.Generator().manual_seed(9)
    T, I = 5, 32
    x, z, w = torch.randn(T, I, generator=gen), torch.randn(T, I, generator=gen), torch.randn(I, generator=gen)
    out = ssd_gated_norm(x, w, z, I // groups, 1e-5)
    h = (x * F.silu(z)).double()
    expect = torch.cat([g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5) for g in h.split(I // groups, -1)], -1)
    assert_close(out, expect * w.double(), 1e-6, "gated norm")
    if groups > 1:  # the grouping matters: one norm over all channels gives something else
        whole = ssd_gated_norm(x, w, z, I, 1e-5)
        assert (whole - out).abs().max() > 1e-3


def test_registered():
    ops = registered()
    for name in ("ssd_dt", "ssd_recurrent", "ssd_chunk", "ssd_gated_norm"):
        assert "reference" in ops[name].impls
    inp = make_inputs((4,), seed=10)
    y, _ = call("ssd_chunk", **inp, chunk_size=16)
    assert_close(y, ssd_recurrent(**inp)[0], RTOL[torch.float32], "through the registry")
