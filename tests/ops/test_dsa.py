"""DSA: the lightning indexer's causal top-k drives sparse MLA; absorbed MLA equals naive MLA."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops.attention.mla import mla_absorbed, mla_naive
from dayzero.ops.attention.reference import indices_to_mask
from dayzero.ops.indexer.reference import indexer_scores, indexer_topk

# Small MLA: H heads, N nope dims, P rope dims, R latent rank, Vd value dims; indexer Hi x Di.
H, N, P, R, VD = 4, 16, 8, 32, 12
HI, DI = 16, 32
SCALE = (N + P) ** -0.5
REL_TOL = 1e-5


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def max_abs(a, b):
    return (a.double() - b.double()).abs().max().item()


def mla_inputs(S, Tq, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(Tq, H, N, generator=g)
    q_pe = torch.randn(Tq, H, P, generator=g)
    latent = torch.randn(S, R + P, generator=g)
    kv_b = torch.randn(H * (N + VD), R, generator=g) * R**-0.5
    q_pos = torch.arange(S - Tq, S, dtype=torch.int64)
    return q_nope, q_pe, latent, kv_b, q_pos


def indexer_inputs(S, Tq, seed=0):
    g = torch.Generator().manual_seed(1000 + seed)
    q = torch.randn(Tq, HI, DI, generator=g)
    weights = torch.randn(Tq, HI, generator=g) * (HI * DI) ** -0.5  # signed, as weights_proj gives
    k = torch.randn(S, DI, generator=g)
    return q, weights, k


def brute_force_scores(q, weights, k, q_pos):
    """I[t, s] = sum_h w[t, h] ReLU(q[t, h] . k[s]) for s <= q_pos[t], else -inf; head by head, fp64."""
    Tq, S = q.shape[0], k.shape[0]
    scores = torch.zeros(Tq, S, dtype=torch.float64)
    for h in range(q.shape[1]):
        dots = q[:, h].double() @ k.double().T  # [Tq, S]
        scores += weights[:, h, None].double() * torch.clamp(dots, min=0)
    future = torch.arange(S)[None, :] > q_pos[:, None]
    return scores.masked_fill(future, float("-inf"))


def brute_force_topk(scores, q_pos, topk):
    """Per query, the set of its top min(topk, q_pos+1) keys, and the gap at the cut (inf if no cut)."""
    sets, gaps = [], []
    for t in range(scores.shape[0]):
        n_valid = int(q_pos[t]) + 1
        vals, order = torch.sort(scores[t, :n_valid], descending=True)
        n = min(topk, n_valid)
        sets.append(set(order[:n].tolist()))
        gaps.append((vals[n - 1] - vals[n]).item() if n < n_valid else float("inf"))
    return sets, min(gaps)


def chosen_sets(indices):
    return [set(i for i in row.tolist() if i >= 0) for row in indices]


def sparse_inputs_without_ties(S, Tq, topk):
    """Indexer inputs whose top-k has a clear cut (gap > 1e-4) for every query; reseeds otherwise."""
    q_pos = torch.arange(S - Tq, S, dtype=torch.int64)
    for seed in range(50):
        q, w, k = indexer_inputs(S, Tq, seed)
        sets, gap = brute_force_topk(brute_force_scores(q, w, k, q_pos), q_pos, topk)
        if gap > 1e-4:
            return q, w, k, q_pos, sets
    raise AssertionError("no seed without a near-tie at the top-k cut")


# (S, Tq): prefill, decode (q_pos = S-1), a chunk continuing a sequence, one token
SHAPES = [(37, 37), (37, 1), (50, 13), (1, 1), (64, 64)]
SHAPE_IDS = [f"S{s}-T{t}-H{H}-HI{HI}" for s, t in SHAPES]


@pytest.mark.parametrize("topk_extra", [0, 5], ids=["topk=S", "topk=S+5"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_full_topk_equals_dense(shape, topk_extra):
    S, Tq = shape
    q_nope, q_pe, latent, kv_b, q_pos = mla_inputs(S, Tq)
    q, w, k = indexer_inputs(S, Tq)
    idx = indexer_topk(q, w, k, q_pos, S + topk_extra)
    assert idx.shape == (Tq, S + topk_extra) and idx.dtype == torch.int64
    mask = indices_to_mask(idx, S)
    # every causal key is selected
    assert torch.equal(mask, torch.arange(S)[None, :] <= q_pos[:, None])
    dense = mla_naive(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE)
    sparse = mla_naive(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE, key_mask=mask)
    assert rel_err(sparse, dense) <= REL_TOL and max_abs(sparse, dense) <= 1e-5


@pytest.mark.parametrize("shape", [(64, 64), (64, 20), (64, 1)], ids=["S64-T64", "S64-T20", "S64-T1"])
def test_topk_matches_brute_force(shape):
    S, Tq = shape
    topk = 8
    q, w, k, q_pos, sets = sparse_inputs_without_ties(S, Tq, topk)
    torch.testing.assert_close(indexer_scores(q, w, k, q_pos), brute_force_scores(q, w, k, q_pos).float())
    idx = indexer_topk(q, w, k, q_pos, topk)
    assert idx.shape == (Tq, topk) and idx.dtype == torch.int64
    assert chosen_sets(idx) == sets
    # blocked top-k selects the same keys
    assert chosen_sets(indexer_topk(q, w, k, q_pos, topk, q_block=3)) == sets


@pytest.mark.parametrize("form", [mla_naive, mla_absorbed], ids=["naive", "absorbed"])
def test_only_selected_keys_are_attended(form):
    S, Tq, topk = 64, 64, 8
    q, w, k, q_pos, sets = sparse_inputs_without_ties(S, Tq, topk)
    q_nope, q_pe, latent, kv_b, _ = mla_inputs(S, Tq)
    mask = indices_to_mask(indexer_topk(q, w, k, q_pos, topk), S)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in mask] == sets
    out = form(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE, key_mask=mask)
    # the sparse result really differs from dense attention once a query has more than topk keys
    dense = form(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE)
    assert (out[topk:] - dense[topk:]).abs().amax(dim=(1, 2)).min() > 1e-4

    g = torch.Generator().manual_seed(7)
    for t in range(Tq):
        selected = sorted(sets[t])
        # rewriting every latent row query t did not select leaves its output unchanged (bit for bit)
        moved = latent.clone()
        others = torch.ones(S, dtype=torch.bool)
        others[selected] = False
        moved[others] = torch.randn(int(others.sum()), R + P, generator=g) * 10
        out_moved = form(q_nope, q_pe, moved, kv_b, VD, q_pos, SCALE, key_mask=mask)
        assert torch.equal(out_moved[t], out[t]), f"query {t} read a key outside its top-{topk}"
        # rewriting one selected row changes it
        hit = latent.clone()
        hit[selected[0]] = torch.randn(R + P, generator=g) * 3
        out_hit = form(q_nope, q_pe, hit, kv_b, VD, q_pos, SCALE, key_mask=mask)
        assert (out_hit[t] - out[t]).abs().max() > 1e-4, f"query {t} ignored its selected key {selected[0]}"


@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sinks"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_absorbed_equals_naive(shape, sparse, sinks):
    S, Tq = shape
    q_nope, q_pe, latent, kv_b, q_pos = mla_inputs(S, Tq, seed=3)
    mask = None
    if sparse:
        q, w, k = indexer_inputs(S, Tq, seed=3)
        mask = indices_to_mask(indexer_topk(q, w, k, q_pos, 8), S)
    sink = torch.randn(H, generator=torch.Generator().manual_seed(5)) if sinks else None
    naive = mla_naive(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE, key_mask=mask, sinks=sink)
    absorbed = mla_absorbed(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE, key_mask=mask, sinks=sink)
    assert naive.shape == absorbed.shape == (Tq, H, VD)
    assert rel_err(absorbed, naive) <= REL_TOL and max_abs(absorbed, naive) <= 1e-5


def test_absorbed_equals_naive_bf16():
    S, Tq = 37, 37
    q_nope, q_pe, latent, kv_b, q_pos = mla_inputs(S, Tq, seed=4)
    args = [x.bfloat16() for x in (q_nope, q_pe, latent, kv_b)]
    naive = mla_naive(args[0], args[1], args[2], args[3], VD, q_pos, SCALE)
    absorbed = mla_absorbed(args[0], args[1], args[2], args[3], VD, q_pos, SCALE)
    assert naive.dtype == absorbed.dtype == torch.bfloat16
    # both are fp32 math on the same rounded inputs; only the output rounding differs
    assert rel_err(absorbed, naive) <= 1e-2


def test_mla_naive_is_mha_over_expanded_keys():
    # An independent check of the naive form: expand k and v per head by hand, causal softmax.
    S, Tq = 23, 23
    q_nope, q_pe, latent, kv_b, q_pos = mla_inputs(S, Tq, seed=6)
    c, k_pe = latent[:, :R], latent[:, R:]
    kv = (c @ kv_b.T).view(S, H, N + VD)
    k = torch.cat([kv[..., :N], k_pe[:, None].expand(S, H, P)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * SCALE
    scores = scores.masked_fill(torch.ones(Tq, S, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hts,shv->thv", scores.softmax(-1), kv[..., N:])
    out = mla_naive(q_nope, q_pe, latent, kv_b, VD, q_pos, SCALE)
    assert rel_err(out, ref) <= REL_TOL


@pytest.mark.parametrize("shape", [(20, 20), (10, 6), (3, 1)], ids=["S20-T20", "S10-T6", "S3-T1"])
def test_early_queries_get_all_causal_keys(shape):
    S, Tq = shape
    topk = 8
    q, w, k = indexer_inputs(S, Tq)
    q_pos = torch.arange(S - Tq, S, dtype=torch.int64)
    idx = indexer_topk(q, w, k, q_pos, topk)
    assert idx.shape == (Tq, topk)
    for t in range(Tq):
        n_valid = int(q_pos[t]) + 1
        row = idx[t].tolist()
        real = [i for i in row if i >= 0]
        assert len(real) == min(topk, n_valid) and len(set(real)) == len(real)
        assert all(0 <= i <= q_pos[t] for i in real)
        assert row.count(-1) == topk - min(topk, n_valid)
        if n_valid <= topk:
            assert set(real) == set(range(n_valid))
