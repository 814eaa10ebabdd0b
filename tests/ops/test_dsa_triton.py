"""The DSA decode kernels (indexer scores over the paged key pool, split-K absorbed MLA) against the PyTorch
decode paths and the per-sequence references: on the CPU through Triton's interpreter at tiny shapes
(tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), and on a GPU at the real model's shapes, captured
in a CUDA graph. Pools hold NaN wherever no sequence owns a row, and ±inf/NaN in the stale tail of each
sequence's last (reused) block, so a kernel that reads a row it must not read fails."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.cache.quant import QuantPagedPool
from dayzero.cache.rows import read_rows, slots_of
from dayzero.engine.batch import ForwardBatch
from dayzero.ops.attention import cuda as attn_dev
from dayzero.ops.attention import paged as attn_ref
from dayzero.ops.indexer import cuda as idx_dev
from dayzero.ops.indexer import reference as idx_ref
from tests.ops.paged_batch import capture, make_batch, make_pool, num_blocks_of, on_device

pytest.importorskip("triton")
from dayzero.ops.attention import triton_mla  # noqa: E402
from dayzero.ops.indexer import triton_indexer  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FP32_REFUSED = DEV == "cuda"  # the kernels leave fp32 pools on a GPU to PyTorch (paged_pool_refusal)

# (block size, cached tokens per sequence): each decode row's position is its start. Positions at the end and
# the start of a block, a sequence with a single key (position 0), key widths that are not a tile multiple.
CASES = {"bs4-edges": (4, [3, 17, 8]), "bs4-one": (4, [0]), "bs16-edges": (16, [15, 16, 0]), "bs16-long": (16, [40, 2])}


def close(a, b, tol):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all()
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item()
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol * (1 + b.abs().max().item()) and rel <= tol, (err, rel)


def poisoned_pool(batch: ForwardBatch, row: tuple[int, ...], seed: int, dtype, num_blocks: int | None = None):
    """make_pool's pool, with +inf, -inf, NaN, ... in the rows after each sequence's last token in its last
    block: what a reused block's earlier owner may have left there."""
    batch = on_device(batch, "cpu")  # the pool is built on the host, then moved
    pool = make_pool(batch, row, num_blocks or num_blocks_of(batch), seed)
    flat, bs = pool.view(-1, *row), batch.block_size
    for b, n in enumerate(batch.seq_lens):
        for i, p in enumerate(range(n, -(-n // bs) * bs)):
            flat[batch.block_tables[b, p // bs] * bs + p % bs] = (float("inf"), float("-inf"), float("nan"))[i % 3]
    return pool.to(dtype).to(DEV)


def quantised_pool(plain: torch.Tensor, kind: str, out_dtype) -> QuantPagedPool:
    """``plain``'s rows quantised per token (fp8 / int8 codes, one scale a row), as the cache writes them; where
    ``plain`` holds no finite row (no sequence owns it, or a stale row) the codes are NaN (fp8) or 127 and the
    scale is inf: a kernel that reads such a row fails."""
    nb, bs, width = plain.shape
    pool = QuantPagedPool(nb, bs, (width,), kind, False, plain.device, out_dtype)
    flat = plain.view(-1, width).float()
    live = flat.isfinite().all(-1)
    pool.write(live.nonzero().squeeze(-1), flat[live])
    dead = (~live).view(nb, bs)
    pool.data.view(torch.uint8)[dead] = 0x7F  # NaN in e4m3, 127 in int8
    pool.scale[dead] = float("inf")
    return pool


def fp32_rows(pool):
    """A quantised pool read as fp32 rows (the same codes and scales), or a plain pool itself."""
    if not isinstance(pool, QuantPagedPool):
        return pool
    view = copy.copy(pool)
    view.out_dtype = torch.float32
    return view


def decode_step(case: str, seed: int = 0) -> ForwardBatch:
    bs, starts = CASES[case]
    return make_batch(starts, [1] * len(starts), bs, seed=seed)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


def causal_selection(batch: ForwardBatch, topk: int, seed: int, width: int | None = None) -> torch.Tensor:
    """[B, topk] a random subset of each row's causal keys, -1 padded (here and there -1 inside the list too),
    as a view into a wider buffer like the step's top-k buffer."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.full((batch.num_tokens, width or topk + 3), -1, dtype=torch.int64)
    for r, p in enumerate(batch.positions.tolist()):
        pick = torch.randperm(p + 1, generator=g)[:topk]
        slots = torch.randperm(topk, generator=g)[: len(pick)]
        buf[r, slots] = pick
    return buf.to(DEV)[:, :topk]


# ---------------------------------------------------------------- the indexer

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads", [(4, 8), (72, 32)], ids=["Hi4-Di8", "Hi72-Di32"])
@pytest.mark.parametrize("block_n", [16, None], ids=["N16", "auto"])
@pytest.mark.parametrize("case", list(CASES))
def test_indexer_decode_scores_equal_the_torch_gather(case, block_n, heads, dtype):
    batch = on_device(decode_step(case, seed=1), DEV)
    Hi, Di = heads
    k = poisoned_pool(batch, (Di,), 2, dtype)
    q, w = randn(batch.num_seqs, Hi, Di, seed=3, dtype=dtype), randn(batch.num_seqs, Hi, seed=4, scale=Hi**-0.5)
    scores = torch.full((batch.num_seqs, batch.key_width), float("nan"), device=DEV)  # every entry must be written
    out = triton_indexer.decode_scores(q, w, k, batch.block_tables, batch.positions, batch.block_size, scores, block_n)
    ref = idx_dev.decode_scores_torch(q, w, k, batch)
    assert out is scores and torch.equal(out.isinf(), ref.isinf()) and not out.isnan().any()
    finite = ref.isfinite()
    close(out[finite], ref[finite], TOL[dtype])


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", ["bs4-edges", "bs16-long"])
def test_indexer_reads_quantised_keys(case, dtype, kind):
    """fp8 / int8 key pools (``index_cache_dtype``): the kernels score the codes and scale each key's score, as
    the PyTorch path scores the dequantised keys; the varlen form too."""
    batch = on_device(decode_step(case, seed=21), DEV)
    Hi, Di = 6, 32
    k = quantised_pool(poisoned_pool(batch, (Di,), 22, torch.float32), kind, dtype)
    q, w = randn(batch.num_seqs, Hi, Di, seed=23, dtype=dtype), randn(batch.num_seqs, Hi, seed=24, scale=Hi**-0.5)
    if dtype == torch.float32 and DEV == "cuda":
        assert "fp32 model" in triton_indexer.refusal(q, w, k)
        return
    assert triton_indexer.refusal(q, w, k) is None
    out = triton_indexer.decode_scores(q, w, k, batch.block_tables, batch.positions, batch.block_size)
    ref = idx_dev.decode_scores_torch(q, w, k, batch)
    assert torch.equal(out.isinf(), ref.isinf()) and not out.isnan().any()
    close(out[ref.isfinite()], ref[ref.isfinite()], TOL[dtype])

    batch, seq = prefill_step(4)
    k = quantised_pool(poisoned_pool(batch, (Di,), 25, torch.float32), kind, dtype)
    T = batch.num_tokens
    q, w = randn(T, Hi, Di, seed=26, dtype=dtype), randn(T, Hi, seed=27)
    scores = torch.full((T, batch.key_width), float("nan"), device=DEV)
    triton_indexer.varlen_scores(q, w, k, batch.block_tables, seq, batch.positions, 4, scores, block_m=16, block_n=16)
    for b in range(batch.num_seqs):
        rows, n = batch.rows(b), batch.seq_lens[b]
        ref = idx_ref.indexer_scores(q[rows], w[rows], read_rows(k, batch.key_slots(b)), batch.positions[rows])
        assert torch.equal(scores[rows, :n].isinf(), ref.isinf()) and (scores[rows, n:] == float("-inf")).all()
        close(scores[rows, :n][ref.isfinite()], ref[ref.isfinite()], TOL[dtype])


def test_per_channel_quantised_pools_are_refused():
    batch = on_device(decode_step("bs4-edges"), DEV)
    pool = QuantPagedPool(num_blocks_of(batch), 4, (16,), "int8", True, DEV, torch.bfloat16)
    q, w = randn(batch.num_seqs, 2, 16, seed=1, dtype=torch.bfloat16), randn(batch.num_seqs, 2, seed=2)
    assert "per-channel" in triton_indexer.refusal(q, w, pool)


@pytest.mark.parametrize("topk", [3, 8, 64])
@pytest.mark.parametrize("case", list(CASES))
def test_indexer_decode_op_selects_the_reference_keys(case, topk):
    batch = on_device(decode_step(case, seed=topk), DEV)
    k = poisoned_pool(batch, (16,), 5, torch.float32)
    q, w = randn(batch.num_seqs, 4, 16, seed=6), randn(batch.num_seqs, 4, seed=7)
    assert triton_indexer.refusal(q, w, k) is None or DEV == "cuda"  # fp32 pools take the PyTorch path on a GPU
    empty = lambda: torch.full((batch.num_seqs, topk), 7, dtype=torch.int64, device=DEV)  # noqa: E731
    dev = idx_dev.paged_indexer_topk_decode(q, w, k, batch, topk, empty())
    ref = idx_ref.paged_indexer_topk(q, w, k, batch, topk, empty())
    assert torch.equal(dev.sort(-1).values, ref.sort(-1).values)


def prefill_step(bs: int) -> tuple[ForwardBatch, torch.Tensor]:
    """A mixed step: a fresh prompt, a decode row, a chunk continuing a sequence; and each row's sequence."""
    batch = make_batch([0, 9, 3], [7, 1, 20], bs, seed=14)
    news = torch.tensor([7, 1, 20])
    return on_device(batch, DEV), torch.repeat_interleave(torch.arange(3), news).to(DEV)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("bs", [4, 16])
def test_indexer_varlen_equals_the_reference_in_bounded_chunks(bs, dtype):
    batch, seq = prefill_step(bs)
    T, Hi, Di, topk = batch.num_tokens, 5, 16, 4
    k = poisoned_pool(batch, (Di,), 8, dtype)
    q, w = randn(T, Hi, Di, seed=9, dtype=dtype), randn(T, Hi, seed=10)
    scores = torch.full((T, batch.key_width), float("nan"), device=DEV)
    triton_indexer.varlen_scores(q, w, k, batch.block_tables, seq, batch.positions, bs, scores, block_m=16, block_n=16)
    for b in range(batch.num_seqs):  # each sequence's rows against its own keys, -inf past them
        rows, n = batch.rows(b), batch.seq_lens[b]
        ref = idx_ref.indexer_scores(q[rows], w[rows], read_rows(k, batch.key_slots(b)), batch.positions[rows])
        assert (scores[rows, n:] == float("-inf")).all()
        assert torch.equal(scores[rows, :n].isinf(), ref.isinf())
        close(scores[rows, :n][ref.isfinite()], ref[ref.isfinite()], TOL[dtype])

    per_row = batch.key_width * 4 + topk * 12
    budget = 5 * per_row + 3  # five rows a chunk: the 28 rows take six chunks
    assert triton_indexer.chunk_rows(batch.key_width, topk, budget) == 5
    assert triton_indexer.scratch_bytes(T, batch.key_width, topk, budget) <= budget
    out = torch.full((T, topk), 7, dtype=torch.int64, device=DEV)
    triton_indexer.varlen_topk(q, w, k, batch.block_tables, seq, batch.positions, bs, topk, out, budget=budget,
                               block_m=16, block_n=16)
    if dtype == torch.float32:  # bf16 scores may break near-ties the other way
        ref = idx_ref.paged_indexer_topk(q, w, k, batch, topk, torch.empty(T, topk, dtype=torch.int64, device=DEV))
        assert torch.equal(out.sort(-1).values, ref.sort(-1).values)
    assert ((out >= 0).sum(-1) == (batch.positions + 1).clamp(max=topk)).all()


@pytest.mark.parametrize("step", ["decode", "mixed"])
@pytest.mark.parametrize("cuts", [(), (3, 11)], ids=["whole", "chunks"])
def test_partial_scores_op_equals_the_reference(step, cuts):
    """Tensor parallelism's scores on the device: a rank's heads scored over row chunks of the step (decode rows or
    a mixed step), no host length read, as the per-sequence reference scores them."""
    batch = on_device(decode_step("bs4-edges", seed=2), DEV) if step == "decode" else prefill_step(4)[0]
    T, W = batch.num_tokens, batch.key_width
    cuts = tuple(c for c in cuts if c < T)
    k = poisoned_pool(batch, (16,), 11, torch.bfloat16)  # bf16: the pool the kernels take on a GPU
    q, w = randn(T, 4, 16, seed=12, dtype=torch.bfloat16), randn(T, 4, seed=13)
    assert idx_dev._verify_scores(q, w, k, batch, torch.empty(T, W, device=DEV)) is None
    for t0, t1 in zip((0,) + cuts, cuts + (T,)):
        got = idx_dev.paged_indexer_scores(q, w, k, batch, torch.full((t1 - t0, W), float("nan"), device=DEV), t0)
        want = idx_ref.paged_indexer_scores(q, w, k, batch, torch.empty(t1 - t0, W, device=DEV), t0)
        assert torch.equal(got.isinf(), want.isinf()) and not got.isnan().any()
        close(got[want.isfinite()], want[want.isfinite()], TOL[torch.bfloat16])
    assert "key width" in idx_dev._verify_scores(q, w, k, batch, torch.empty(T, W + 1, device=DEV))


def test_scratch_bytes_stay_under_the_budget_at_long_context():
    keys, topk = 128 * 1024, 2048
    assert triton_indexer.scratch_bytes(keys, keys, topk) <= triton_indexer.SCRATCH_BUDGET
    assert triton_indexer.chunk_rows(keys, topk) >= 256
    # 8 segments of 16K keys: two-stage top-k, its candidates (8 segments' and the final k) counted too
    assert triton_indexer.scratch_bytes(3, keys, topk) == 3 * (keys * 4 + topk * 12 * (8 + 2))


# ---------------------------------------------------------------- sparse and dense absorbed MLA

def mla_inputs(batch, H, dtype, seed=20, N=8, P=8, V=6, R=24):
    B = batch.num_seqs
    q_nope, q_pe = randn(B, H, N, seed=seed, dtype=dtype), randn(B, H, P, seed=seed + 1, dtype=dtype)
    kv_b = randn(H * (N + V), R, seed=seed + 2, dtype=dtype, scale=R**-0.5)
    latent = poisoned_pool(batch, (R + P,), seed + 3, dtype)
    return q_nope, q_pe, latent, kv_b, V


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads_splits", [(3, None), (20, 3)], ids=["H3", "H20-S3"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk5"])
@pytest.mark.parametrize("case", list(CASES))
def test_mla_decode_equals_the_torch_path(case, sparse, sinks, heads_splits, dtype):
    batch = on_device(decode_step(case, seed=21), DEV)
    H, splits = heads_splits
    qn, qp, lat, kv_b, V = mla_inputs(batch, H, dtype)
    s = randn(H, seed=22) if sinks else None
    sel = causal_selection(batch, 5, 23) if sparse else None
    scale = 0.3
    if splits is None:  # through the op, as the layer calls it, against the PyTorch path and the reference
        why = triton_mla.refusal(torch.zeros(batch.num_seqs, H, lat.shape[-1], device=DEV), lat, sel)
        assert why is None or (DEV == "cuda" and dtype == torch.float32)
        out = attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, batch, scale, s, sel)
        close(out, attn_dev.paged_mla_decode_torch(qn, qp, lat, kv_b, V, batch, scale, s, sel), TOL[dtype])
        if dtype == torch.float32:
            close(out, attn_ref.paged_mla(qn, qp, lat, kv_b, V, batch, scale, s, sel), TOL[dtype])
        return
    R = kv_b.shape[1]
    q_abs = randn(batch.num_seqs, H, lat.shape[-1], seed=24)
    o = triton_mla.mla_decode(q_abs, lat, batch.block_tables, batch.positions, batch.block_size, R, scale, s, sel,
                              splits=splits)
    assert o.shape == (batch.num_seqs, H, R) and o.dtype == torch.float32
    close(o, latent_attention(q_abs, lat, batch, R, scale, s, sel), TOL[dtype])
    early = triton_mla.mla_decode(q_abs, lat, batch.block_tables, batch.positions, batch.block_size, R, scale, s, sel,
                                  splits=splits, early=True)
    assert torch.equal(early, o)  # the first tile of keys read before the wait: the same values
    # q~'s rope columns given apart, its latent ones as a strided view, o_lat written in bf16: the same values
    # up to that rounding (the layer's form: no concatenation, no cast after)
    q_lat = q_abs[..., :R].transpose(0, 1).contiguous().transpose(0, 1)  # no rope columns after its rows
    apart = triton_mla.mla_decode(q_lat, lat, batch.block_tables, batch.positions, batch.block_size, R, scale, s,
                                  sel, splits=splits, q_pe=q_abs[..., R:].clone(), out_dtype=torch.bfloat16)
    assert apart.dtype == torch.bfloat16
    close(apart.float(), o, TOL[torch.bfloat16])


def latent_attention(q_abs, lat, batch, R, scale, sinks, selection):
    """o_lat by the PyTorch decode path's own pieces (gather, masked sink softmax), for q_abs given."""
    kp, ok = attn_dev.key_positions(batch) if selection is None else (selection, selection >= 0)
    rows = read_rows(lat, slots_of(batch.block_tables, kp, batch.block_size)).float()
    return attn_dev._attend(q_abs[:, None], rows[:, :, None], rows[:, :, None, :R], ok, scale, sinks)[:, 0]


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk5"])
def test_mla_reads_quantised_latent_rows(sparse, dtype, kind):
    """fp8 / int8 latent pools (``kv_cache_dtype``): decode rows through the op against its PyTorch path (which
    dequantises the rows), split and not; then a mixed step's prefill rows through the kernel against the
    reference over the same dequantised pool."""
    batch = on_device(decode_step("bs4-edges", seed=61), DEV)
    H = 20
    qn, qp, plain, kv_b, V = mla_inputs(batch, H, dtype, seed=62)
    lat = quantised_pool(plain.float(), kind, dtype)
    s, sel = randn(H, seed=63), causal_selection(batch, 5, 64) if sparse else None
    if dtype == torch.float32 and DEV == "cuda":
        assert "fp32 model" in triton_mla.refusal(torch.zeros(batch.num_seqs, H, 32, device=DEV), lat, sel)
        return
    assert triton_mla.refusal(torch.zeros(batch.num_seqs, H, 32, device=DEV), lat, sel) is None
    out = attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, batch, 0.3, s, sel)
    close(out, attn_dev.paged_mla_decode_torch(qn, qp, lat, kv_b, V, batch, 0.3, s, sel), TOL[dtype])
    q_abs = randn(batch.num_seqs, H, 32, seed=65)
    o = triton_mla.mla_decode(q_abs, lat, batch.block_tables, batch.positions, batch.block_size, 24, 0.3, s, sel,
                              splits=3)
    close(o, latent_attention(q_abs, lat, batch, 24, 0.3, s, sel), TOL[dtype])

    batch, _ = prefill_step(4)
    T = batch.num_tokens
    qn, qp = randn(T, H, 8, seed=66, dtype=dtype), randn(T, H, 8, seed=67, dtype=dtype)
    lat = quantised_pool(poisoned_pool(batch, (32,), 68, torch.float32), kind, dtype)
    sel = causal_selection(batch, 5, 69) if sparse else None
    assert attn_dev._mla_verify(qn, qp, lat, kv_b, V, batch, 0.3, s, sel) is None
    out = attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, batch, 0.3, s, sel)
    ref = attn_ref.paged_mla(qn.float(), qp.float(), lat, kv_b.float(), V, batch, 0.3, s, sel)
    close(out.float(), ref.float(), TOL[dtype])


@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_mla_reads_only_valid_selected_keys(sinks):
    """Entries past the row's position (stale rows: ±inf/NaN) and -1 entries count for nothing; a row that
    selects nothing gets 0 (the sink is in the denominator only)."""
    batch = on_device(decode_step("bs4-edges", seed=25), DEV)
    H, R, P = 4, 24, 8
    lat = poisoned_pool(batch, (R + P,), 26, torch.float32)
    q_abs = randn(batch.num_seqs, H, R + P, seed=27)
    s = randn(H, seed=28) if sinks else None
    sel = causal_selection(batch, 6, 29)
    bad = sel.clone()
    pos = batch.positions
    bad[:, 0] = pos + 1  # past the row's position: the poisoned tail of its block
    bad[:, 1] = batch.key_width + 3  # past the table
    bad[2] = -1  # row 2 selects nothing
    good = torch.where((bad >= 0) & (bad <= pos[:, None]), bad, -1)
    for splits in (None, 2):
        o = triton_mla.mla_decode(q_abs, lat, batch.block_tables, pos, batch.block_size, R, 0.4, s, bad, splits)
        close(o, latent_attention(q_abs, lat, batch, R, 0.4, s, good), TOL[torch.float32])
        assert torch.equal(o[2], torch.zeros_like(o[2]))


def test_num_splits_depend_on_shapes_only():
    assert triton_mla.num_splits(1, 128, 2048) == 16  # top-2048: 128 keys a split
    assert triton_mla.num_splits(1, 16, 128 * 1024) == triton_mla.MAX_SPLITS
    assert triton_mla.num_splits(64, 128, 2048) == 1  # 512 programs fill the device already
    assert triton_mla.num_splits(3, 3, 5) == 1
    assert triton_mla.num_splits(1, 16, 560) == 18  # few heads: one 32-key tile a split


# ---------------------------------------------------------------- prefill rows through the ops

def test_seq_of_row_follows_cu_seqlens():
    batch, seq = prefill_step(4)
    assert torch.equal(batch.seq_of_row, seq)
    decode = on_device(decode_step("bs4-edges"), DEV)
    assert torch.equal(decode.seq_of_row, torch.arange(decode.num_seqs, device=DEV))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk5"])
@pytest.mark.parametrize("bs", [4, 16])
def test_mla_prefill_rows_equal_the_reference(bs, sparse, sinks, dtype):
    """A mixed step (a fresh prompt, a decode row, a continued chunk): every row through the absorbed kernel,
    reading its own sequence's table, against the per-sequence reference (naive form for the chunks)."""
    batch, _ = prefill_step(bs)
    T, H, N, P, V, R = batch.num_tokens, 5, 8, 8, 6, 24
    qn, qp = randn(T, H, N, seed=41, dtype=dtype), randn(T, H, P, seed=42, dtype=dtype)
    kv_b = randn(H * (N + V), R, seed=43, dtype=dtype, scale=R**-0.5)
    lat = poisoned_pool(batch, (R + P,), 44, dtype)
    s = randn(H, seed=45) if sinks else None
    sel = causal_selection(batch, 5, 46) if sparse else None
    if FP32_REFUSED and dtype == torch.float32:
        assert "fp32" in attn_dev._mla_verify(qn, qp, lat, kv_b, V, batch, 0.3, s, sel)  # the reference runs them
        return
    assert attn_dev._mla_verify(qn, qp, lat, kv_b, V, batch, 0.3, s, sel) is None
    out = attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, batch, 0.3, s, sel)
    ref = attn_ref.paged_mla(qn.float(), qp.float(), lat.float(), kv_b.float(), V, batch, 0.3, s, sel)
    close(out.float(), ref, TOL[dtype])


def test_mla_prefill_refusals_name_the_reason(monkeypatch):
    batch, _ = prefill_step(4)
    T, H, N, P, V, R = batch.num_tokens, 2, 8, 8, 6, 24
    dt = torch.bfloat16 if FP32_REFUSED else torch.float32
    qn, qp = randn(T, H, N, seed=1, dtype=dt), randn(T, H, P, seed=2, dtype=dt)
    kv_b = randn(H * (N + V), R, seed=3, dtype=dt)
    lat = poisoned_pool(batch, (R + P,), 4, dt)
    monkeypatch.setattr(attn_dev, "DENSE_PREFILL_MAX_KEYS", batch.key_width - 1)
    why = attn_dev._mla_verify(qn, qp, lat, kv_b, V, batch, 1.0)
    assert "prefill rows" in why and f"over {batch.key_width} keys" in why
    assert attn_dev._mla_verify(qn, qp, lat, kv_b, V, batch, 1.0, None, causal_selection(batch, 5, 5)) is None
    decode = on_device(decode_step("bs4-edges"), DEV)
    assert attn_dev._mla_verify(qn, qp, lat, kv_b, V, decode, 1.0) is None  # decode rows: the PyTorch path at worst
    why = attn_dev._mla_verify(qn, qp, lat[..., :-1], kv_b, V, batch, 1.0, None, causal_selection(batch, 5, 5))
    assert "does not match latent rows" in why


@pytest.mark.parametrize("topk", [4, 64])
def test_indexer_op_takes_prefill_rows(topk):
    """The op's varlen path on a mixed step selects the reference's keys (fp32: no near-tie flips)."""
    batch, _ = prefill_step(4)
    T, Hi, Di = batch.num_tokens, 3, 16
    k = poisoned_pool(batch, (Di,), 47, torch.float32)
    q, w = randn(T, Hi, Di, seed=48), randn(T, Hi, seed=49)
    if FP32_REFUSED:  # the bf16 varlen kernel is checked above; fp32 pools on a GPU are the reference's
        assert "fp32" in idx_dev._verify(q, w, k, batch)
        return
    assert idx_dev._verify(q, w, k, batch) is None
    out = idx_dev.paged_indexer_topk_decode(q, w, k, batch, topk, torch.full((T, topk), 7, dtype=torch.int64, device=DEV))
    ref = idx_ref.paged_indexer_topk(q, w, k, batch, topk, torch.empty(T, topk, dtype=torch.int64, device=DEV))
    assert torch.equal(out.sort(-1).values, ref.sort(-1).values)
    assert "quantised" in idx_dev._verify(q, w, object(), batch)


# ---------------------------------------------------------------- on a GPU, at the real model's shapes

def long_step(starts: list[int], bs: int, seed: int) -> ForwardBatch:
    return on_device(make_batch(starts, [1] * len(starts), bs, seed=seed), DEV)


@gpu
@pytest.mark.parametrize("pool", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("heads", [32, 64], ids=["Hi32", "Hi64"])
@pytest.mark.parametrize("bs", [16, 64])
def test_gpu_indexer_decode_at_real_shapes(heads, bs, pool):
    batch = long_step([8191, 2047, 5000], bs, seed=30)
    k = poisoned_pool(batch, (128,), 31, torch.bfloat16)
    if pool != "bf16":
        k = quantised_pool(k.float(), pool, torch.bfloat16)
    q = randn(3, heads, 128, seed=32, dtype=torch.bfloat16)
    w = randn(3, heads, seed=33, scale=(heads * 128) ** -0.5)
    # the torch path reads a quantised pool's rows dequantised to its dtype (bf16: a 2^-9 rounding of each key),
    # where the kernel multiplies the codes and applies each row's scale after: its reference reads them in fp32
    ref = idx_dev.decode_scores_torch(q, w, fp32_rows(k), batch)
    out = triton_indexer.decode_scores(q, w, k, batch.block_tables, batch.positions, bs)
    assert torch.equal(out.isinf(), ref.isinf())
    close(out[ref.isfinite()], ref[ref.isfinite()], 1e-4)
    sel = idx_dev.paged_indexer_topk_decode(q, w, k, batch, 2048, torch.empty(3, 2048, dtype=torch.int64, device=DEV))
    want = ref.topk(2048, dim=-1).values.sort(-1).values
    got = ref.gather(1, sel.clamp(min=0)).masked_fill(sel < 0, float("-inf")).sort(-1).values
    assert torch.equal(got.isinf(), want.isinf())  # same count of real keys; scores equal up to near-ties
    close(got[want.isfinite()], want[want.isfinite()], 1e-4)


@gpu
@pytest.mark.parametrize("pool", ["bf16", "fp8", "int8"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "topk2048"])
@pytest.mark.parametrize("H", [16, 64, 128])
def test_gpu_mla_decode_at_real_shapes(H, sparse, pool):
    batch = long_step([8191, 3000, 0, 2047], 64, seed=34)
    R, P, N, V = 512, 64, 128, 128
    qn, qp = randn(4, H, N, seed=35, dtype=torch.bfloat16), randn(4, H, P, seed=36, dtype=torch.bfloat16)
    kv_b = randn(H * (N + V), R, seed=37, dtype=torch.bfloat16, scale=R**-0.5)
    lat = poisoned_pool(batch, (R + P,), 38, torch.bfloat16)
    if pool != "bf16":
        lat = quantised_pool(lat.float(), pool, torch.bfloat16)
    s = randn(H, seed=39)
    sel = causal_selection(batch, 2048, 40) if sparse else None
    out = attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, batch, (N + P) ** -0.5, s, sel)
    close(out, attn_dev.paged_mla_decode_torch(qn, qp, lat, kv_b, V, batch, (N + P) ** -0.5, s, sel), 2e-2)


@gpu
def test_gpu_decode_step_replays_in_a_cuda_graph():
    """Indexer top-k then sparse MLA captured once, replayed on other positions and tables: same as eager."""
    bs, Hi, H, R, P, N, V, topk = 64, 64, 16, 512, 64, 128, 128, 2048
    first, second = long_step([8191, 100, 4000], bs, 41), long_step([3000, 8000, 2048], bs, 41)
    nb = max(num_blocks_of(first), num_blocks_of(second))
    pools = [(poisoned_pool(b, (128,), 42, torch.bfloat16, nb), poisoned_pool(b, (R + P,), 43, torch.bfloat16, nb))
             for b in (first, second)]
    (k, lat), (k2, lat2) = pools
    q, w = randn(3, Hi, 128, seed=44, dtype=torch.bfloat16), randn(3, Hi, seed=45, scale=(Hi * 128) ** -0.5)
    qn, qp = randn(3, H, N, seed=46, dtype=torch.bfloat16), randn(3, H, P, seed=47, dtype=torch.bfloat16)
    kv_b = randn(H * (N + V), R, seed=48, dtype=torch.bfloat16, scale=R**-0.5)
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    tables = torch.zeros(3, width, dtype=torch.int64, device=DEV)
    positions = torch.zeros(3, dtype=torch.int64, device=DEV)
    static = ForwardBatch(positions.clone(), positions, [0, 1, 2, 3], None, None, positions.clone(), tables,
                          positions.clone(), positions.clone(), bs, fresh=positions.bool())
    sel = torch.empty(3, topk, dtype=torch.int64, device=DEV)

    def step():
        idx_dev.paged_indexer_topk_decode(q, w, k, static, topk, sel)
        return attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, static, 0.1, None, sel)

    def load(batch, kp, lp):
        tables.zero_()[:, : batch.block_tables.shape[1]] = batch.block_tables
        positions.copy_(batch.positions)
        k.copy_(kp)
        lat.copy_(lp)

    load(first, k, lat)
    graph, out = capture(step)
    for batch, kp, lp in ((first, k.clone(), lat.clone()), (second, k2, lat2)):
        load(batch, kp, lp)
        graph.replay()
        torch.cuda.synchronize()
        replayed, chosen = out.clone(), sel.clone()
        assert torch.equal(chosen.sort(-1).values, idx_dev.paged_indexer_topk_decode(
            q, w, k, static, topk, torch.empty_like(sel)).sort(-1).values)
        close(replayed, attn_dev.paged_mla_rows(qn, qp, lat, kv_b, V, static, 0.1, None, sel), 1e-3)


def test_kernels_compile_for_hopper_without_a_gpu():
    """The indexer, MLA and paged GQA kernels over bf16, fp8 and int8 pools through Triton's sm90 front end,
    layouts and ptxas: catches what the interpreter accepts and a GPU build does not (a dtype returned from a jit
    function)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.ops.attention_triton_aot"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("pool): shared") == 12, proc.stdout
