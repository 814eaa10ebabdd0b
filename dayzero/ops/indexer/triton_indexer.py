"""The DSA lightning indexer's scores over the paged indexer-key pool as Triton kernels, decode and varlen.

    score[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . k[s])      for s <= pos[t], else -inf

(``reference.py``'s math; q and the weights already carry RoPE and every scale.) A quantised pool (fp8 / int8
codes, one scale per key: ``index_cache_dtype``) is read as codes, exact in the model's dtype, and since the
ReLU commutes with a positive factor each key's scale multiplies its finished score. Both kernels gather the keys
of a tile of positions through the sequence's block table (slot = block_id * block_size + row) with masked
loads, so a row past the query's position is never read: a stale row of a reused block may hold inf/NaN.

- decode: one query per sequence. One program per (row, tile of keys); the heads are the M side of the dot,
  [Hi, Di] x [Di, keys], so Hi=64 fills a tensor-core tile, and the ReLU-weighted sum over heads happens in
  registers. Tiles wholly past the row's position skip the dot (block tables are padded to a captured width).
- varlen (prefill): a tile of query rows against a tile of keys; rows of one sequence share the key tile, and
  a tile that straddles sequences loops over them. Rows are scored in chunks so that the [rows, keys] fp32
  scratch (plus top-k's outputs) stays under a byte budget: :func:`scratch_bytes` says how much, so that the
  cache planner can count it.

Top-k follows with ``torch.topk`` exactly as the PyTorch decode op does (-1 past the causal keys). No device
value is read on the host: the decode form runs inside captured CUDA graphs. Dots accumulate in fp32; the
query is cast to the pool's dtype for them (bf16 on the tensor cores; fp32 pools use IEEE fp32 dots).
"""
from __future__ import annotations

import torch

from dayzero.ops.triton_support import (DOT_F32, HAS_TRITON, next_pow2, paged_pool_refusal, pdl, pool_operands, tl,
                                        triton, triton_refusal)

if HAS_TRITON:
    from dayzero.ops.triton_support import TORCH_TO_TL

# Keys per decode program: 128 halves the query re-reads (q is [Hi, Di], as large as 64 keys) once that still
# makes about two waves of an H200's 132 SMs; 64 otherwise. A shape choice, fixed for a captured graph.
DECODE_BLOCK_N, DECODE_BLOCK_N_SMALL, TARGET_PROGRAMS = 128, 64, 264
PREFILL_BLOCK_M, PREFILL_BLOCK_N = 64, 64  # query rows x keys per varlen program
MAX_HEADS, MAX_DIM = 128, 256
# Bytes the varlen form may hold at once for one chunk of rows: fp32 scores [rows, keys] + top-k's outputs.
SCRATCH_BUDGET = 256 << 20
_TOPK_BYTES = 4 + 8  # top-k's fp32 values and int64 indices, per selected key
# A long row's top-k goes in two stages: the top k of each segment of TOPK_SEGMENT keys (or 4k, if larger), all
# segments of all rows at once, then the top k of those candidates. One torch.topk over a row of 1M scores
# selects within one slice, which the GPU runs with little parallelism; rows of at least TOPK_MIN_SEGMENTS
# segments take the two stages.
TOPK_SEGMENT, TOPK_MIN_SEGMENTS = 16384, 4

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _key_tile(k_ptr, row, offs_d, valid, d_ok, QUANT: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr):
        """The key rows at element offsets ``row`` [BN] as [BN, BD] for the dots: in the pool's dtype, or for
        quantised codes (exact in bf16) in the model's dtype ``DT``, the dtype the query is rounded to."""
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:  # (the interpreter also casts int8 codes to bf16 wrongly; to fp32 they are exact)
            k = k.to(tl.float32)
        elif QUANT:
            k = k.to(DT)
        return k

    @triton.jit
    def _decode_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, table_ptr, pos_ptr, out_ptr, key_width,
                              s_qb, s_qh, s_wb, s_kb, s_kr, s_sb, s_tb, s_ob,
                              HI: tl.constexpr, DI: tl.constexpr, PAGE: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                              PRECISION: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, DT: tl.constexpr):
        grid_dependency(PDL)
        b = tl.program_id(0).to(tl.int64)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < DI
        pos = tl.load(pos_ptr + b)
        valid = (offs_n <= pos) & (offs_n < key_width)  # [BN]
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if n0 <= pos:  # a tile past the query's position has no key to score
            blk = tl.load(table_ptr + b * s_tb + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
            row = blk * s_kb + (offs_n % PAGE).to(tl.int64) * s_kr  # [BN] element offsets of the key rows
            k = _key_tile(k_ptr, row, offs_d, valid, d_ok, QUANT, DT, DOT_F32)
            dt: tl.constexpr = DT if QUANT else k_ptr.dtype.element_ty  # q is rounded to it for the dots
            for h0 in tl.static_range(0, HI, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                h_ok = offs_h < HI
                q = tl.load(q_ptr + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :],
                            mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(dt).to(k.dtype)  # [BH, BD]
                w = tl.load(w_ptr + b * s_wb + offs_h, mask=h_ok, other=0.0).to(tl.float32)  # [BH]
                logits = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BH, BN] fp32
                acc += tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
            if QUANT:  # ReLU(x * scale) = scale * ReLU(x): a key's scale multiplies its whole score
                acc *= tl.load(ks_ptr + blk * s_sb + offs_n % PAGE, mask=valid, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * s_ob + offs_n, tl.where(valid, acc, float("-inf")), mask=offs_n < key_width)

    @triton.jit
    def _varlen_scores_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, table_ptr, seq_ptr, pos_ptr, out_ptr, T, key_width,
                              s_qt, s_qh, s_wt, s_kb, s_kr, s_sb, s_tb, s_ot,
                              HI: tl.constexpr, DI: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                              PRECISION: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr, DT: tl.constexpr):
        grid_dependency(PDL)
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < DI
        m_ok = offs_m < T
        seq = tl.load(seq_ptr + offs_m, mask=m_ok, other=-1)  # [BM]
        pos = tl.load(pos_ptr + offs_m, mask=m_ok, other=-1)  # [BM]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # the sequences of this tile's rows: one, unless the tile straddles a boundary (rows sorted by sequence)
        s = tl.min(tl.where(m_ok, seq, 1 << 30), axis=0)
        s_last = tl.max(seq, axis=0)
        while s <= s_last:  # a while loop: the interpreter cannot take device bounds in range()
            mine = m_ok & (seq == s)
            last = tl.max(tl.where(mine, pos, -1), axis=0)  # the keys any of its rows may read end here
            if n0 <= last:
                valid = (offs_n <= last) & (offs_n < key_width)
                blk = tl.load(table_ptr + s.to(tl.int64) * s_tb + offs_n // PAGE, mask=valid, other=0).to(tl.int64)
                row = blk * s_kb + (offs_n % PAGE).to(tl.int64) * s_kr
                k = _key_tile(k_ptr, row, offs_d, valid, d_ok, QUANT, DT, DOT_F32)
                dt: tl.constexpr = DT if QUANT else k_ptr.dtype.element_ty
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for h in range(HI):
                    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * s_qt + h * s_qh + offs_d[None, :],
                                mask=mine[:, None] & d_ok[None, :], other=0.0).to(dt).to(k.dtype)  # [BM, BD]
                    w = tl.load(w_ptr + offs_m * s_wt + h, mask=mine, other=0.0).to(tl.float32)  # [BM]
                    part += tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0) * w[:, None]
                if QUANT:  # as in the decode kernel: the key's scale multiplies its score
                    sc = tl.load(ks_ptr + blk * s_sb + offs_n % PAGE, mask=valid, other=0.0).to(tl.float32)
                    part *= sc[None, :]
                acc = tl.where(mine[:, None], part, acc)
            s += 1
        causal = (offs_n[None, :] <= pos[:, None]) & (offs_n[None, :] < key_width)
        tl.store(out_ptr + offs_m[:, None].to(tl.int64) * s_ot + offs_n[None, :], tl.where(causal, acc, float("-inf")),
                 mask=m_ok[:, None] & (offs_n[None, :] < key_width))


def refusal(q: torch.Tensor, weights: torch.Tensor, k_pool) -> str | None:
    """Why the Triton indexer cannot score ``q`` [T, Hi, Di] against ``k_pool``, or None when it can."""
    why = triton_refusal(q) or paged_pool_refusal(k_pool, "indexer-key", quantised=True)
    if why is not None:
        return why
    width = pool_operands(k_pool)[0].shape[-1]
    if q.dim() != 3 or q.shape[-1] != width or weights.shape != q.shape[:2]:
        return f"q {tuple(q.shape)} / weights {tuple(weights.shape)} do not match keys of width {width}"
    Hi, Di = q.shape[1:]
    if Hi > MAX_HEADS or Di > MAX_DIM:
        return f"Hi={Hi} / Di={Di} exceed the kernel's {MAX_HEADS} heads / {MAX_DIM} dims"
    return None


def _pool_args(pool) -> tuple[tuple, dict]:
    """The kernels' pool arguments (codes, scales, their strides) and constexprs for a plain or quantised pool."""
    rows, scales, quant, dtype = pool_operands(pool)
    precision = "ieee" if dtype == torch.float32 else "tf32"  # tf32 is unused for 16-bit operands
    return ((rows, scales), (rows.stride(0), rows.stride(1), scales.stride(0)),
            dict(PRECISION=precision, QUANT=quant, DT=TORCH_TO_TL[dtype]))


def decode_scores(q: torch.Tensor, weights: torch.Tensor, k_pool: torch.Tensor, block_tables: torch.Tensor,
                  positions: torch.Tensor, block_size: int, scores: torch.Tensor | None = None,
                  block_n: int | None = None) -> torch.Tensor:
    """Masked fp32 scores [B, key_width] of every decode row's one query against its block table's keys
    (key_width = table width * block_size), into ``scores`` when given. -inf past the row's position."""
    # q: [B, Hi, Di]; weights: [B, Hi]; k_pool: [num_blocks, block_size, Di]; block_tables: [B, W]
    B, Hi, Di = q.shape
    key_width = block_tables.shape[1] * block_size
    if scores is None:
        scores = torch.empty(B, key_width, dtype=torch.float32, device=q.device)
    assert scores.shape == (B, key_width) and scores.dtype == torch.float32 and scores.stride(-1) == 1
    if B == 0 or key_width == 0:
        return scores
    q, weights, block_tables = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, weights, block_tables))
    BH = min(64, max(16, next_pow2(Hi)))
    if block_n is None:
        wide = B * triton.cdiv(key_width, DECODE_BLOCK_N) >= TARGET_PROGRAMS
        block_n = DECODE_BLOCK_N if wide else DECODE_BLOCK_N_SMALL
    pools, strides, flags = _pool_args(k_pool)
    _decode_scores_kernel[(B, triton.cdiv(key_width, block_n))](
        q, weights, *pools, block_tables, positions, scores, key_width,
        q.stride(0), q.stride(1), weights.stride(0), *strides, block_tables.stride(0),
        scores.stride(0), HI=Hi, DI=Di, PAGE=block_size, BLOCK_H=BH, BLOCK_D=max(16, next_pow2(Di)),
        BLOCK_N=block_n, DOT_F32=DOT_F32, num_warps=8 if block_n > 64 else 4, **flags, **pdl(q))
    return scores


def topk_segments(key_width: int, kk: int) -> tuple[int, int]:
    """(segments, keys per segment) of the first stage of a row's top-``kk``; (1, key_width): one stage."""
    seg = max(TOPK_SEGMENT, 4 * kk)
    n = key_width // seg
    return (n, seg) if n >= TOPK_MIN_SEGMENTS else (1, key_width)


def topk_indices(scores: torch.Tensor, kk: int) -> torch.Tensor:
    """[T, kk] indices of each row's ``kk`` largest ``scores`` [T, W], sorted by score (largest first). A long
    row: the top ``kk`` of each segment (a strided view, no copy) and of the tail, then of those candidates."""
    T, W = scores.shape
    n, seg = topk_segments(W, kk)
    if n == 1:
        return torch.topk(scores, kk, dim=-1, sorted=True).indices
    body = scores.as_strided((T, n, seg), (scores.stride(0), seg, 1))  # [T, n, seg]: the first n*seg keys
    vals, idx = torch.topk(body, kk, dim=-1, sorted=False)  # [T, n, kk]
    idx = idx + torch.arange(0, n * seg, seg, device=scores.device)[:, None]
    vals, idx = vals.flatten(1), idx.flatten(1)
    if W > n * seg:  # the tail past the last whole segment
        tv, ti = torch.topk(scores[:, n * seg:], min(kk, W - n * seg), dim=-1, sorted=False)
        vals, idx = torch.cat((vals, tv), dim=1), torch.cat((idx, ti + n * seg), dim=1)
    best = torch.topk(vals, kk, dim=-1, sorted=True).indices
    return idx.gather(1, best)


def topk_bytes(key_width: int, topk: int) -> int:
    """Scratch of one row's top-k beyond its scores: the outputs, and the first stage's candidates if any."""
    kk = min(topk, key_width)
    n, _ = topk_segments(key_width, kk)
    return kk * _TOPK_BYTES * (1 if n == 1 else n + 2)


def topk_of_scores(scores: torch.Tensor, positions: torch.Tensor, topk: int, out: torch.Tensor) -> torch.Tensor:
    """``out`` [T, topk] (returned): each row's top min(topk, position+1) keys of its masked ``scores``, in any
    order, -1 padded. Sorted top-k puts the finite (causal) scores first, so slot j is a key iff j <= position."""
    kk = min(topk, scores.shape[1])
    idx = topk_indices(scores, kk)
    n_valid = (positions + 1)[:, None]
    out[:, :kk] = torch.where(torch.arange(kk, device=scores.device) < n_valid, idx, -1)
    out[:, kk:] = -1
    return out


def chunk_rows(key_width: int, topk: int, budget: int = SCRATCH_BUDGET) -> int:
    """Query rows the varlen form scores at once so that its scratch stays under ``budget`` (at least 1)."""
    per_row = key_width * 4 + topk_bytes(key_width, topk)
    return max(1, budget // max(1, per_row))


def scratch_bytes(num_rows: int, key_width: int, topk: int, budget: int = SCRATCH_BUDGET) -> int:
    """Bytes of scratch the varlen form holds at once for ``num_rows`` query rows over ``key_width`` keys
    (one chunk's fp32 scores and top-k outputs): at most ``budget``, unless one row alone is larger."""
    rows = min(num_rows, chunk_rows(key_width, topk, budget))
    return rows * (key_width * 4 + topk_bytes(key_width, topk))


def varlen_scores(q: torch.Tensor, weights: torch.Tensor, k_pool: torch.Tensor, block_tables: torch.Tensor,
                  seq_of_row: torch.Tensor, positions: torch.Tensor, block_size: int, scores: torch.Tensor,
                  block_m: int = PREFILL_BLOCK_M, block_n: int = PREFILL_BLOCK_N) -> torch.Tensor:
    """Masked fp32 ``scores`` [T, key_width] (returned) of query rows t against the keys of their sequences
    ``seq_of_row[t]`` (rows of a sequence contiguous, sequences in increasing order: other orders are still
    right, only slower), -inf past ``positions[t]``. One call holds all T rows: see :func:`varlen_topk`."""
    # q: [T, Hi, Di]; weights: [T, Hi]; block_tables: [B, W]; seq_of_row, positions: [T] int
    T, Hi, Di = q.shape
    key_width = block_tables.shape[1] * block_size
    assert scores.shape == (T, key_width) and scores.dtype == torch.float32 and scores.stride(-1) == 1
    if T == 0 or key_width == 0:
        return scores
    q, weights, block_tables = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, weights, block_tables))
    pools, strides, flags = _pool_args(k_pool)
    _varlen_scores_kernel[(triton.cdiv(T, block_m), triton.cdiv(key_width, block_n))](
        q, weights, *pools, block_tables, seq_of_row, positions, scores, T, key_width,
        q.stride(0), q.stride(1), weights.stride(0), *strides, block_tables.stride(0),
        scores.stride(0), HI=Hi, DI=Di, PAGE=block_size, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(Di)),
        BLOCK_N=block_n, DOT_F32=DOT_F32, num_warps=8, **flags, **pdl(q))
    return scores


def varlen_topk(q: torch.Tensor, weights: torch.Tensor, k_pool: torch.Tensor, block_tables: torch.Tensor,
                seq_of_row: torch.Tensor, positions: torch.Tensor, block_size: int, topk: int, out: torch.Tensor,
                *, budget: int = SCRATCH_BUDGET, block_m: int = PREFILL_BLOCK_M,
                block_n: int = PREFILL_BLOCK_N) -> torch.Tensor:
    """Prefill form: ``out`` [T, topk] (returned), query row t's top min(topk, positions[t]+1) causal keys of
    sequence ``seq_of_row[t]`` (any order, -1 padded). The rows are scored in chunks of :func:`chunk_rows`
    into one reused scratch, so that it never exceeds ``budget`` (:func:`scratch_bytes`)."""
    T = q.shape[0]
    key_width = block_tables.shape[1] * block_size
    if T == 0 or topk == 0:
        return out
    if key_width == 0:
        return out.fill_(-1)
    rows = min(T, chunk_rows(key_width, topk, budget))
    scratch = torch.empty(rows, key_width, dtype=torch.float32, device=q.device)
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        scores = varlen_scores(q[t0:t1], weights[t0:t1], k_pool, block_tables, seq_of_row[t0:t1],
                               positions[t0:t1], block_size, scratch[: t1 - t0], block_m, block_n)
        topk_of_scores(scores, positions[t0:t1], topk, out[t0:t1])
    return out
