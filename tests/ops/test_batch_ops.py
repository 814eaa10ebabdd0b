"""Batch-wide ops (one call per layer over the whole step): the device decode implementations, called here on
CPU tensors, equal the per-sequence references on decode steps with fresh and continuing sequences, block
boundaries, odd batch sizes and padding rows; the references on mixed steps (prefill chunks beside decode
rows) equal each sequence run alone. Pools hold NaN wherever no sequence owns a row."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.cache.rows import read_rows
from dayzero.ops.attention import compressed as comp_ref
from dayzero.ops.attention import compressed_cuda as comp_dev
from dayzero.ops.attention import cuda as attn_dev
from dayzero.ops.attention import paged as attn_ref
from dayzero.ops.indexer import cuda as idx_dev
from dayzero.ops.indexer import reference as idx_ref
from dayzero.ops.kda import cuda as kda_dev
from dayzero.ops.kda import reference as kda_ref
from dayzero.ops.ssd import cuda as ssd_dev
from dayzero.ops.ssd import reference as ssd_ref
from tests.ops.paged_batch import make_batch, make_pool, num_blocks_of

BS = 4
# decode steps: cached tokens per sequence (one new token each): fresh, block ends and starts, long ones
DECODE_STARTS = {"B1": [9], "B5": [0, 3, 4, 7, 12], "B7": [1, 0, 15, 8, 2, 11, 5]}


def close(a, b, tol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def alone(batch, b, seed=0):
    """Sequence b of ``batch`` as a batch of its own, with the same block table and slot."""
    from dayzero.engine.batch import ForwardBatch

    rows = batch.rows(b)
    n = rows.stop - rows.start
    return ForwardBatch(batch.input_ids[rows], batch.positions[rows], [0, n], [batch.seq_start[b]], [batch.seq_lens[b]],
                        batch.slot_mapping[rows], batch.block_tables[b:b + 1], batch.state_slots[b:b + 1],
                        torch.tensor([n - 1]), batch.block_size)


# ---------------------------------------------------------------- paged attention (GQA)

@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
@pytest.mark.parametrize("window", [None, 3, 64], ids=["full", "win3", "win64"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_paged_attention_decode_equals_reference(starts, window, sinks):
    batch = make_batch(starts, [1] * len(starts), BS, seed=len(starts))
    H, Hkv, D = 4, 2, 8
    nb = num_blocks_of(batch)
    k, v = make_pool(batch, (Hkv, D), nb, 1), make_pool(batch, (Hkv, 6), nb, 2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(len(starts), H, D, generator=g)
    s = torch.randn(H, generator=g) if sinks else None
    ref = attn_ref.paged_attention(q, k, v, batch, 0.4, s, window)
    close(attn_dev.paged_attention_decode(q, k, v, batch, 0.4, s, window), ref)


def test_paged_attention_mixed_step_equals_each_sequence_alone():
    batch = make_batch([0, 5, 9, 3], [6, 1, 3, 1], BS, seed=4)
    H, D = 4, 8
    nb = num_blocks_of(batch)
    k, v = make_pool(batch, (1, D), nb, 1), make_pool(batch, (1, D), nb, 2)
    q = torch.randn(batch.num_tokens, H, D, generator=torch.Generator().manual_seed(5))
    out = attn_ref.paged_attention(q, k, v, batch, 0.3, None, 4)
    for b in range(batch.num_seqs):
        rows = batch.rows(b)
        close(out[rows], attn_ref.paged_attention(q[rows], k, v, alone(batch, b), 0.3, None, 4))


def test_padding_rows_change_no_real_row():
    starts = [3, 8, 0]
    plain, padded = make_batch(starts, [1, 1, 1], BS, seed=6), make_batch(starts, [1, 1, 1], BS, seed=6, pad_rows=5)
    nb = num_blocks_of(padded)
    k, v = make_pool(padded, (2, 8), nb, 1), make_pool(padded, (2, 8), nb, 2)
    q = torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(7))
    out = attn_dev.paged_attention_decode(q, k, v, padded, 0.5)
    assert torch.isfinite(out).all()
    close(out[:3], attn_dev.paged_attention_decode(q[:3], k, v, plain, 0.5))


# ---------------------------------------------------------------- MLA and the DSA indexer

def random_selection(batch, topk, seed):
    """[B, topk] a random subset of each decode row's causal keys (min(topk, pos+1) of them), -1 padded."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((batch.num_tokens, topk), -1, dtype=torch.int64)
    for r, p in enumerate(batch.positions.tolist()):
        pick = torch.randperm(p + 1, generator=g)[:topk]
        out[r, : len(pick)] = pick
    return out


@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk5"])
def test_paged_mla_decode_equals_reference(starts, sparse):
    batch = make_batch(starts, [1] * len(starts), BS, seed=len(starts) + 10)
    H, N, P, V, R = 3, 8, 4, 6, 16
    latent = make_pool(batch, (R + P,), num_blocks_of(batch), 1)
    g = torch.Generator().manual_seed(8)
    qn, qp = torch.randn(len(starts), H, N, generator=g), torch.randn(len(starts), H, P, generator=g)
    kv_b = torch.randn(H * (N + V), R, generator=g) * 0.3
    sinks = torch.randn(H, generator=g)
    sel = random_selection(batch, 5, 9) if sparse else None
    ref = attn_ref.paged_mla(qn, qp, latent, kv_b, V, batch, 0.35, sinks, sel)
    close(attn_dev.paged_mla_rows(qn, qp, latent, kv_b, V, batch, 0.35, sinks, sel), ref)


def test_paged_mla_mixed_step_equals_each_sequence_alone():
    batch = make_batch([0, 6, 2], [5, 1, 7], BS, seed=11)
    H, N, P, V, R = 2, 8, 4, 6, 12
    latent = make_pool(batch, (R + P,), num_blocks_of(batch), 2)
    g = torch.Generator().manual_seed(12)
    qn, qp = torch.randn(batch.num_tokens, H, N, generator=g), torch.randn(batch.num_tokens, H, P, generator=g)
    kv_b = torch.randn(H * (N + V), R, generator=g) * 0.3
    sel = idx_ref.paged_indexer_topk(torch.randn(batch.num_tokens, 2, 4, generator=g), torch.randn(batch.num_tokens, 2, generator=g),
                                     make_pool(batch, (4,), num_blocks_of(batch), 3), batch, 4,
                                     torch.empty(batch.num_tokens, 4, dtype=torch.int64))
    out = attn_ref.paged_mla(qn, qp, latent, kv_b, V, batch, 0.3, None, sel)
    for b in range(batch.num_seqs):
        rows = batch.rows(b)
        close(out[rows], attn_ref.paged_mla(qn[rows], qp[rows], latent, kv_b, V, alone(batch, b), 0.3, None, sel[rows]))


@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
@pytest.mark.parametrize("topk", [3, 8])
def test_indexer_decode_selects_the_reference_keys(starts, topk):
    """Same key set per row (order is free), -1 exactly past the causal keys; rows shorter than top-k select
    every causal key."""
    batch = make_batch(starts, [1] * len(starts), BS, seed=topk)
    k = make_pool(batch, (8,), num_blocks_of(batch), 4)
    g = torch.Generator().manual_seed(13)
    q, w = torch.randn(len(starts), 4, 8, generator=g), torch.randn(len(starts), 4, generator=g)
    empty = lambda: torch.full((len(starts), topk), 7, dtype=torch.int64)  # noqa: E731  poisoned: every slot is written
    ref = idx_ref.paged_indexer_topk(q, w, k, batch, topk, empty())
    dev = idx_dev.paged_indexer_topk_decode(q, w, k, batch, topk, empty())
    for r, p in enumerate(batch.positions.tolist()):
        n = min(topk, p + 1)
        assert sorted(dev[r].tolist()) == sorted(ref[r].tolist()), r
        assert (dev[r] >= 0).sum() == n and all(0 <= i <= p for i in dev[r, :n].tolist())


def test_indexer_mixed_step_equals_each_sequence_alone():
    batch = make_batch([0, 9, 3], [7, 1, 4], BS, seed=14)
    k = make_pool(batch, (8,), num_blocks_of(batch), 5)
    g = torch.Generator().manual_seed(15)
    q, w = torch.randn(batch.num_tokens, 4, 8, generator=g), torch.randn(batch.num_tokens, 4, generator=g)
    out = idx_ref.paged_indexer_topk(q, w, k, batch, 3, torch.empty(batch.num_tokens, 3, dtype=torch.int64))
    for b in range(batch.num_seqs):
        rows = batch.rows(b)
        solo = idx_ref.paged_indexer_topk(q[rows], w[rows], k, alone(batch, b), 3,
                                          torch.empty(rows.stop - rows.start, 3, dtype=torch.int64))
        assert torch.equal(out[rows].sort(-1).values, solo.sort(-1).values)


@pytest.mark.parametrize("topk", [3, 8])
@pytest.mark.parametrize("cuts", [(), (2, 9), (1, 5, 6, 11)], ids=lambda c: "rows" + "-".join(map(str, c)))
def test_indexer_partial_scores_sum_to_the_reference_selection(topk, cuts):
    """Tensor parallelism's path: the scores of two halves of the heads, computed over row chunks that cut
    sequences anywhere, add up to the scores of all heads, whose top-k is the reference's key set per row. A
    mixed step: prefill chunks that start past position 0 beside decode rows."""
    batch = make_batch([0, 9, 3, 6], [7, 1, 4, 1], BS, seed=16)
    k = make_pool(batch, (8,), num_blocks_of(batch), 6)
    T, W = batch.num_tokens, batch.key_width
    g = torch.Generator().manual_seed(17)
    q, w = torch.randn(T, 4, 8, generator=g), torch.randn(T, 4, generator=g)
    ref = idx_ref.paged_indexer_topk(q, w, k, batch, topk, torch.empty(T, topk, dtype=torch.int64))
    summed = torch.zeros(T, W)
    for heads in (slice(0, 2), slice(2, 4)):
        for t0, t1 in zip((0,) + cuts, cuts + (T,)):
            poisoned = torch.full((t1 - t0, W), float("nan"))  # every score is written
            summed[t0:t1] += idx_ref.paged_indexer_scores(q[:, heads], w[:, heads], k, batch, poisoned, t0)
    for b in range(batch.num_seqs):  # each sequence's reference scores (-inf past each position), -inf past its keys
        rows = batch.rows(b)
        whole = idx_ref.indexer_scores(q[rows], w[rows], read_rows(k, batch.key_slots(b)), batch.positions[rows])
        close(summed[rows, :batch.seq_lens[b]].clamp_min(-1e30), whole.clamp_min(-1e30))
        assert torch.isneginf(summed[rows, batch.seq_lens[b]:]).all()
    out = idx_ref.topk_of_scores(summed, batch.positions, topk, torch.full((T, topk), 7, dtype=torch.int64))
    assert torch.equal(out.sort(-1).values, ref.sort(-1).values)


# ---------------------------------------------------------------- linear attention over the state pool

def delta_inputs(T, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g)
    v = torch.randn(T, H, V, generator=g)
    gate = -torch.rand(T, H, K, generator=g) * 0.5
    beta = torch.rand(T, H, generator=g)
    return q, k, v, gate, beta


@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
def test_kda_decode_updates_the_pool_like_the_reference(starts):
    batch = make_batch(starts, [1] * len(starts), BS, seed=20)
    H, K, V = 2, 8, 6
    pool = torch.randn(17, H, K, V, generator=torch.Generator().manual_seed(21))
    pool_dev = pool.clone()
    xs = delta_inputs(len(starts), H, K, V, 22)
    o_ref = kda_ref.kda_pooled(*xs, 0.5, pool, batch)
    o_dev = kda_dev.kda_pooled_decode(*xs, 0.5, pool_dev, batch)
    close(o_dev, o_ref)
    close(pool_dev, pool)  # same new states in the batch's slots, every other slot untouched
    fresh = [b for b, s in enumerate(starts) if s == 0]
    if fresh:  # a fresh sequence ignores what its slot held
        stale = pool.clone()
        stale[batch.state_slots[fresh]] = 1e3
        close(kda_dev.kda_pooled_decode(*xs, 0.5, stale, batch)[fresh], o_ref[fresh])


def test_decode_implementations_keep_the_input_dtype():
    batch = make_batch([0, 5, 2], [1, 1, 1], BS, seed=40)
    xs = [x.bfloat16() if i < 3 else x for i, x in enumerate(delta_inputs(3, 2, 8, 6, 41))]
    pool = torch.zeros(17, 2, 8, 6)
    assert kda_dev.kda_pooled_decode(*xs, 0.5, pool, batch).dtype == torch.bfloat16
    assert kda_ref.kda_pooled(*xs, 0.5, pool, batch).dtype == torch.bfloat16
    win = torch.zeros(17, 6, 3, dtype=torch.bfloat16)
    x = torch.randn(3, 6).bfloat16()
    assert kda_dev.causal_conv1d_pooled_decode(x, torch.randn(6, 4), win, batch).dtype == torch.bfloat16


def test_kda_mixed_step_equals_each_sequence_alone():
    batch = make_batch([0, 5, 2], [9, 1, 4], BS, seed=23)
    H, K, V = 2, 8, 6
    pool = torch.randn(17, H, K, V, generator=torch.Generator().manual_seed(24))
    solo_pool = pool.clone()
    xs = delta_inputs(batch.num_tokens, H, K, V, 25)
    out = kda_ref.kda_pooled(*xs, 0.5, pool, batch)
    for b in range(batch.num_seqs):
        rows = batch.rows(b)
        close(out[rows], kda_ref.kda_pooled(*(x[rows] for x in xs), 0.5, solo_pool, alone(batch, b)))
    close(pool, solo_pool)


@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv_decode_updates_the_pool_like_the_reference(starts, activation):
    batch = make_batch(starts, [1] * len(starts), BS, seed=26)
    C, W = 6, 4
    g = torch.Generator().manual_seed(27)
    pool, x, w = torch.randn(17, C, W - 1, generator=g), torch.randn(len(starts), C, generator=g), torch.randn(C, 1, W, generator=g)
    pool_dev = pool.clone()
    close(kda_dev.causal_conv1d_pooled_decode(x, w, pool_dev, batch, activation),
          kda_ref.causal_conv1d_pooled(x, w, pool, batch, activation))
    close(pool_dev, pool)


@pytest.mark.parametrize("starts", list(DECODE_STARTS.values()), ids=list(DECODE_STARTS))
def test_ssd_decode_updates_the_pool_like_the_reference(starts):
    batch = make_batch(starts, [1] * len(starts), BS, seed=28)
    T, H, P, N, G = len(starts), 4, 3, 5, 2
    g = torch.Generator().manual_seed(29)
    x, dt = torch.randn(T, H, P, generator=g), torch.rand(T, H, generator=g) * 0.5
    A, D = -torch.rand(H, generator=g), torch.randn(H, generator=g)
    B, Cm = torch.randn(T, G, N, generator=g), torch.randn(T, G, N, generator=g)
    pool = torch.randn(17, H, P, N, generator=g)
    pool_dev = pool.clone()
    close(ssd_dev.ssd_pooled_decode(x, dt, A, B, Cm, D, pool_dev, batch), ssd_ref.ssd_pooled(x, dt, A, B, Cm, D, pool, batch))
    close(pool_dev, pool)


# ---------------------------------------------------------------- DeepSeek-V4 compressed attention

M = 2  # tokens per compressed entry in these tests (block size 4: two entries per block)
COMPRESSED_STARTS = {"B1": [5], "B5": [1, 3, 0, 6, 11], "B6": [7, 2, 9, 0, 4, 1]}


@pytest.mark.parametrize("starts", list(COMPRESSED_STARTS.values()), ids=list(COMPRESSED_STARTS))
@pytest.mark.parametrize("overlap", [False, True], ids=["hca", "csa"])
def test_compress_windows_decode_equals_reference(starts, overlap):
    """Rows whose window completes pool it into the same entry at the same slot; the rings end up equal."""
    batch = make_batch(starts, [1] * len(starts), BS, seed=30)
    R, W = M * (2 if overlap else 1), 6 * (2 if overlap else 1)
    g = torch.Generator().manual_seed(31)
    raw, gate = torch.randn(len(starts), W, generator=g), torch.randn(len(starts), W, generator=g)
    rings = [torch.randn(17, R, W, generator=g) for _ in range(2)]
    bias = torch.randn(M, W, generator=g)
    dev_rings = [r.clone() for r in rings]
    pooled, w, slots = comp_ref.compress_windows(raw, gate, *rings, bias, overlap, batch)
    d_pooled, d_w, d_slots = comp_dev.compress_windows_decode(raw, gate, *dev_rings, bias, overlap, batch)
    complete = [b for b, s in enumerate(starts) if (s + 1) % M == 0]
    assert len(complete) == pooled.shape[0] > 0
    close(d_pooled[complete], pooled)
    assert torch.equal(d_w[complete], w) and torch.equal(d_slots[complete], slots)
    assert (d_slots[[b for b in range(len(starts)) if b not in complete]] == 0).all()  # the null slot
    for a, b in zip(dev_rings, rings):
        close(a, b)


@pytest.mark.parametrize("starts", list(COMPRESSED_STARTS.values()), ids=list(COMPRESSED_STARTS))
@pytest.mark.parametrize("kind", ["swa", "hca", "csa"])
def test_compressed_attention_decode_equals_reference(starts, kind):
    batch = make_batch(starts, [1] * len(starts), BS, seed=32)
    B, H, D, window = len(starts), 3, 8, 4
    g = torch.Generator().manual_seed(33)
    q, kv = torch.randn(B, H, D, generator=g), torch.randn(B, D, generator=g)
    ring = torch.randn(17, window, D, generator=g)
    entries = None if kind == "swa" else make_pool(batch, (D,), num_blocks_of(batch), 34, stride=M)
    sel = None
    if kind == "csa":
        index = make_pool(batch, (4,), num_blocks_of(batch), 35, stride=M)
        iq, iw = torch.randn(B, 2, 4, generator=g), torch.randn(B, 2, generator=g)
        sel = comp_ref.compressed_indexer_topk(iq, iw, index, M, batch, 2)
        dev_sel = comp_dev.compressed_indexer_topk_decode(iq, iw, index, M, batch, 2)
        assert torch.equal(sel.sort(-1).values, dev_sel.sort(-1).values)
    sinks = torch.randn(H, generator=g)
    dev_ring = ring.clone()
    ref = comp_ref.compressed_paged_attention(q, kv, ring, entries, sel, M, batch, 0.3, sinks, window)
    close(comp_dev.compressed_paged_attention_decode(q, kv, dev_ring, entries, sel, M, batch, 0.3, sinks, window), ref)
    close(dev_ring, ring)


def test_compress_rows_equals_compress_pool_per_row():
    g = torch.Generator().manual_seed(36)
    m, W = 3, 8
    kv, gate = torch.randn(4, 2 * m, W, generator=g), torch.randn(4, 2 * m, W, generator=g)
    bias = torch.randn(m, W, generator=g)
    has_prev = torch.tensor([True, False, True, True])
    out = comp_ref.compress_rows(kv[:, m:], gate[:, m:], bias, True, kv[:, :m], gate[:, :m], has_prev)
    for b in range(4):
        prev = (kv[b, :m], gate[b, :m]) if has_prev[b] else (None, None)
        close(out[b:b + 1], comp_ref.compress_pool(kv[b, m:], gate[b, m:], bias, True, *prev))
