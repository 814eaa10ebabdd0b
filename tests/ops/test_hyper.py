"""Hyper-connection references (HY-V4 and DeepSeek-V4 mHC) against per-element loops written from the
docstring math, and Sinkhorn's doubly-stochastic property.

eps and norm_eps are far larger than in the checkpoints so that dropping or moving either one shows up
above the fp32 tolerance.
"""
from __future__ import annotations

import math

import pytest
import torch

import dayzero.ops.hyper.reference  # noqa: F401  (registers hc_pre / hc_post)
from dayzero.ops import call, registered
from dayzero.ops.hyper.reference import sinkhorn

RTOL, ATOL = 1e-5, 1e-6  # fp32 math compared with float64 loops
NORM_EPS, EPS = 0.1, 0.01


def test_registered():
    assert {"hc_pre", "hc_post"} <= set(registered())


def sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def loop_sinkhorn(c: list[list[float]], iters: int, eps: float) -> list[list[float]]:
    """Columns normalised once, then (rows, columns) iters - 1 times; each sum offset by eps."""
    n = len(c)
    c = [row[:] for row in c]

    def columns():
        for k in range(n):
            s = sum(c[j][k] for j in range(n)) + eps
            for j in range(n):
                c[j][k] /= s

    columns()
    for _ in range(iters - 1):
        for j in range(n):
            s = sum(c[j]) + eps
            c[j] = [v / s for v in c[j]]
        columns()
    return c


def loop_hc_pre(h, fn, base, scale, norm_eps, eps, magnitude, post_eps, iters):
    """x, post, comb token by token (float64 tensors; post / comb None where fn has no rows for them)."""
    T, n, D = h.shape
    m = fn.shape[0]
    fn, base, scale = fn.tolist(), base.tolist(), scale.reshape(-1).tolist()
    post_eps = eps if post_eps is None else post_eps
    x = torch.zeros(T, D, dtype=torch.float64)
    post = torch.zeros(T, n, dtype=torch.float64) if m >= 2 * n else None
    comb = torch.zeros(T, n, n, dtype=torch.float64) if m == (2 + n) * n else None
    for t in range(T):
        flat = h[t].reshape(-1).tolist()  # index i*D + d
        r = 1.0 / math.sqrt(sum(v * v for v in flat) / (n * D) + norm_eps)
        mix = [sum(a * b for a, b in zip(fn[row], flat)) * r for row in range(m)]
        pre = [sigmoid(mix[i] * scale[0] + base[i]) + eps for i in range(n)]
        for d in range(D):
            x[t, d] = sum(pre[i] * float(h[t, i, d]) for i in range(n))
        if post is not None:
            for i in range(n):
                post[t, i] = magnitude * sigmoid(mix[n + i] * scale[1] + base[n + i]) + post_eps
        if comb is not None:
            logits = [[mix[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k] for k in range(n)] for j in range(n)]
            c = []
            for row in logits:  # softmax over each row, plus eps
                top = max(row)
                e = [math.exp(v - top) for v in row]
                c.append([v / sum(e) + eps for v in e])
            comb[t] = torch.tensor(loop_sinkhorn(c, iters, eps), dtype=torch.float64)
    return x, post, comb


def loop_hc_post(h, post, y, comb):
    """h'_k = post_k · y + Σ_j comb[j, k] · h_j (h_k without comb)."""
    T, n, D = h.shape
    out = torch.zeros(T, n, D, dtype=torch.float64)
    for t in range(T):
        for k in range(n):
            for d in range(D):
                if comb is None:
                    carried = float(h[t, k, d])
                else:
                    carried = sum(float(comb[t, j, k]) * float(h[t, j, d]) for j in range(n))
                out[t, k, d] = float(post[t, k]) * float(y[t, d]) + carried
    return out


def hc_inputs(T, n, D, rows, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, n, D, generator=g)
    fn = torch.randn(rows, n * D, generator=g) / (n * D) ** 0.5
    base = torch.randn(rows, generator=g)
    scale = torch.tensor([0.7, 1.3, 2.0][: {n: 1, 2 * n: 2}.get(rows, 3)])  # distinct: a swapped scale shows
    return h, fn, base, scale


def assert_close(out, ref):
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)


MHC_CASES = [(5, 4, 8), (1, 4, 16), (3, 2, 6), (4, 3, 5)]  # (T, n, D)


@pytest.mark.parametrize("iters", [1, 2, 20])
@pytest.mark.parametrize("T,n,D", MHC_CASES, ids=[f"T{T}-n{n}-D{D}" for T, n, D in MHC_CASES])
def test_mhc_pre_matches_loop(T, n, D, iters):
    h, fn, base, scale = hc_inputs(T, n, D, (2 + n) * n, seed=T * 10 + n + D)
    x, post, comb = call("hc_pre", h, fn, base, scale, NORM_EPS, EPS, 2.0, 0.0, iters)
    rx, rpost, rcomb = loop_hc_pre(h, fn, base, scale, NORM_EPS, EPS, 2.0, 0.0, iters)
    assert_close(x, rx)
    assert_close(post, rpost)
    assert_close(comb, rcomb)


@pytest.mark.parametrize("T,n,D", MHC_CASES, ids=[f"T{T}-n{n}-D{D}" for T, n, D in MHC_CASES])
def test_mhc_post_matches_loop(T, n, D):
    h, fn, base, scale = hc_inputs(T, n, D, (2 + n) * n, seed=T + n * 10 + D)
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(D))
    _, post, comb = call("hc_pre", h, fn, base, scale, NORM_EPS, EPS, 2.0, 0.0, 3)
    out = call("hc_post", h, post, y, comb)
    assert out.shape == h.shape
    assert_close(out, loop_hc_post(h, post, y, comb))


@pytest.mark.parametrize("n", [2, 4])
def test_mhc_comb_is_nearly_doubly_stochastic(n):
    """Sinkhorn on a row-softmax: the columns (normalised last) sum to 1 up to eps; the rows approach 1
    geometrically (about 1e-2 off after 20 steps on these inputs, 1e-6 after 200)."""
    h, fn, base, scale = hc_inputs(6, n, 8, (2 + n) * n, seed=n)
    eps = 1e-6
    ones = torch.ones(6, n)
    row_err = {}
    for iters in (1, 20, 200):
        _, _, comb = call("hc_pre", h, fn, base, scale, 1e-6, eps, 2.0, 0.0, iters)
        assert (comb > 0).all()
        torch.testing.assert_close(comb.sum(-2), ones, rtol=0, atol=1e-4)  # 1 - eps / (column sum)
        row_err[iters] = float((comb.sum(-1) - 1).abs().max())
    assert row_err[20] < 1e-2 and row_err[200] < 1e-5
    assert row_err[1] > 10 * row_err[20]  # one column step alone leaves the rows far from 1


@pytest.mark.parametrize("iters", [1, 3])
def test_sinkhorn_matches_loop(iters):
    c = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(iters)) + 0.05
    out = sinkhorn(c, iters, EPS)
    ref = torch.tensor([loop_sinkhorn(m.tolist(), iters, EPS) for m in c], dtype=torch.float64)
    assert_close(out, ref)


@pytest.mark.parametrize("T,n,D", [(4, 4, 8), (1, 2, 3)], ids=["T4-n4-D8", "T1-n2-D3"])
def test_two_part_variant(T, n, D):
    """2n rows (HY-V4): no comb; post carries eps unless post_eps says otherwise; hc_post adds h_k."""
    h, fn, base, scale = hc_inputs(T, n, D, 2 * n, seed=T + n + D)
    x, post, comb = call("hc_pre", h, fn, base, scale, NORM_EPS, EPS, 1.5)
    assert comb is None
    rx, rpost, _ = loop_hc_pre(h, fn, base, scale, NORM_EPS, EPS, 1.5, None, 0)
    assert_close(x, rx)
    assert_close(post, rpost)
    _, post0, _ = call("hc_pre", h, fn, base, scale, NORM_EPS, EPS, 1.5, 0.0)
    assert_close(post0, loop_hc_pre(h, fn, base, scale, NORM_EPS, EPS, 1.5, 0.0, 0)[1])
    torch.testing.assert_close(post - post0, torch.full_like(post, EPS), rtol=0, atol=1e-6)
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(1))
    assert_close(call("hc_post", h, post, y), loop_hc_post(h, post, y, None))


def test_head_variant_returns_x_only():
    h, fn, base, scale = hc_inputs(3, 4, 8, 4, seed=7)
    x, post, comb = call("hc_pre", h, fn, base, scale, NORM_EPS, EPS)
    assert post is None and comb is None
    assert_close(x, loop_hc_pre(h, fn, base, scale, NORM_EPS, EPS, 2.0, None, 0)[0])


def test_bad_shapes_and_missing_sinkhorn_iters():
    T, n, D = 2, 4, 8
    h, fn, base, scale = hc_inputs(T, n, D, (2 + n) * n, seed=3)
    bad = [
        (fn[: 3 * n], base[: 3 * n], scale),  # 3n rows: no variant has them
        (fn[: 3 * n], base[: 3 * n], scale[:2]),  # ... whatever the scales
        (fn[:, :-1], base, scale),  # columns are not n*D
        (fn, base[:-1], scale),  # base does not match fn's rows
        (fn, base, scale[:2]),  # mHC needs three scales
        (fn[: 2 * n], base[: 2 * n], scale),  # 2n rows take two scales
    ]
    for f, b, s in bad:
        with pytest.raises(ValueError, match="hc_pre"):
            call("hc_pre", h, f, b, s, NORM_EPS, EPS, 2.0, 0.0, 5)
    for iters in (0, -1):
        with pytest.raises(ValueError, match="sinkhorn_iters"):
            call("hc_pre", h, fn, base, scale, NORM_EPS, EPS, 2.0, 0.0, iters)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        call("hc_pre", h, fn, base, scale, NORM_EPS, EPS)  # the default (0) is not enough for mHC rows
