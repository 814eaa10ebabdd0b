"""Paged, varlen causal GQA/MQA attention over the paged KV pools as one Triton kernel (flash-attention style),
for every query row of a step: prefill chunks and decode rows mixed, with sliding windows and softmax sinks.

The math is ``attention``'s (``reference.py``), per sequence. Query row t (position pos[t], head h) of sequence
b reads key s of b iff

    s <= pos[t]  and  (window is None or s > pos[t] - window)

and gets  o[t, h] = sum_s e^(x_s - m) v_s / (sum_s e^(x_s - m) + e^(sink[h] - m)),  x_s = scale * q[t, h] . k_s,
with m the max over the x_s and the sink (the sink joins the denominator only; without one its term is absent;
a query with no key and no sink gets 0). Softmax and the weighted sum are fp32; the output is in q's dtype.

Layout. ``k_pool`` / ``v_pool`` are [num_blocks, block_size, Hkv, D] (D = Dqk / Dv); key position p of sequence b
is row ``p % block_size`` of block ``block_tables[b, p // block_size]``. Head h reads kv head h // G (G = H / Hkv).

Tiling: one program per (query tile, kv head, block of that kv head's query heads). A query tile is BLOCK_M
consecutive rows of ONE sequence (tiles never straddle sequences, so the whole tile shares one block table and
one key tile serves every row of it), and the BLOCK_G query heads of the kv head are folded into the M
dimension of the dots: the program's M = BLOCK_M * BLOCK_G rows are (row, head) pairs, row-major. The program
walks the keys its rows may read, [min pos - window + 1, max pos + 1) (without a window from 0), in tiles of
BLOCK_N positions gathered through the block table, with an online softmax in the log2 domain (exp2, scale
folded into ``scale * log2 e``); the sink joins the denominator at the end. Only keys of that range are loaded
(masked loads, ``other=0``): past the sequence's newest row, or outside the window of every row of the tile, a
pool row may be stale (inf/NaN) and is never touched. Keys inside the range that a particular row may not read
(the causal diagonal, the window's edge) are loaded, since other rows of the tile read them, and masked to -inf.

Rows to programs, with no host value: sequence b's tiles are numbered from ``cu_seqlens[b] // BLOCK_M + b``
upward, ceil(n_b / BLOCK_M) of them (n_b its rows). These starts increase strictly with b and each sequence's
last tile comes before the next one's first, so ``cdiv(T, BLOCK_M) + B`` programs cover every tile; a program
finds its sequence by a binary search over ``cu_seqlens`` (log2 B scalar loads), and a program in a gap between
two sequences' tiles (at most B of them) has no row and stores nothing. The grid comes from shapes only
(T, B, Hkv, H), so the call can be captured in a CUDA graph and replayed with other positions, tables and
``cu_seqlens`` of the same shapes. (No row -> sequence map is needed; ``seq_of_row`` is accepted and unused.)

Quantised pools (``kv_cache_dtype`` fp8 / int8, as the cache writes them: keys with one scale per channel per
block, values one per token row) are dequantised as they are loaded: a key tile's codes times its blocks'
channel scales; a value row's scale folds into its softmax weight, and its codes (exact in bf16) enter the dot.

Dots run in the pool's dtype on the tensor cores (q and the softmax weights are cast to it), with fp32
accumulation; fp32 pools use IEEE fp32 dots (the interpreter, or a direct call: on a GPU ``refusal`` leaves fp32
pools to the PyTorch paths, see ``paged_pool_refusal``). Head dims need not be powers of two (masked columns).

Limits: there is no split of the key range (flash-decoding), so a decode step of few long sequences fills few
SMs (B * Hkv programs); the key loop is a ``while`` (device bounds), which Triton does not software-pipeline.
"""
from __future__ import annotations

import math

import torch

from dayzero.ops.triton_support import (DOT_F32, HAS_TRITON, next_pow2, paged_pool_refusal, pdl, pool_operands, tl,
                                        triton, triton_refusal)

MAX_HEAD_DIM = 256  # Dqk and Dv up to this
LOG2E = 1.4426950408889634
# (row, head) pairs per program: up to MAX_M with head dims up to 128, MAX_M_WIDE past them (the [M, Dv] fp32
# accumulator stays in registers); at least MIN_M (tl.dot's smallest M). Keys per tile: BLOCK_N / BLOCK_N_WIDE.
# Not tuned on a GPU yet.
MIN_M, MAX_M, MAX_M_WIDE = 16, 128, 64
BLOCK_N, BLOCK_N_WIDE = 64, 32

if HAS_TRITON:
    from dayzero.ops.triton_support import TORCH_TO_TL, grid_dependency, softmax_out

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, table_ptr, cu_ptr, pos_ptr, sink_ptr,
                                B, G, key_width, window, qk_scale,
                                s_qt, s_qh, s_kb, s_kr, s_kh, s_vb, s_vr, s_vh, s_ksb, s_ksh, s_vsb, s_vsr, s_ot,
                                s_oh, s_tb,
                                DQK: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
                                HAS_WINDOW: tl.constexpr, HAS_SINK: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                                DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
                                QUANT: tl.constexpr, DT: tl.constexpr):
        grid_dependency(PDL)
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        gblk = tl.program_id(2)

        # The sequence of this tile: the last b whose first tile number cu[b] // BLOCK_M + b is <= pid.
        lo = pid * 0
        hi = lo + B
        while hi - lo > 1:  # a while loop: the interpreter cannot take device bounds in range()
            mid = (lo + hi) // 2
            go = tl.load(cu_ptr + mid) // BLOCK_M + mid <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        b = lo
        q_start = tl.load(cu_ptr + b).to(tl.int64)
        q_end = tl.load(cu_ptr + b + 1).to(tl.int64)
        row0 = q_start + (pid - (q_start // BLOCK_M + b)) * BLOCK_M

        # M = (row, head) pairs: row-major, BLOCK_G heads of kv head kvh per row
        offs_m = tl.arange(0, BLOCK_M * BLOCK_G)
        rows = row0 + offs_m // BLOCK_G  # int64: row offsets rows * s_qt may pass 2^31
        g = gblk * BLOCK_G + offs_m % BLOCK_G
        m_ok = (rows < q_end) & (g < G)
        heads = kvh * G + g
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        d_ok = offs_d < DQK
        dv_ok = offs_dv < DV

        # the dots' operand dtype: q and p are rounded to it (quantised pools: the model's dtype)
        dt: tl.constexpr = DT if QUANT else k_ptr.dtype.element_ty
        q = tl.load(q_ptr + rows[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(dt)  # [M, BD]
        if DOT_F32:
            q = q.to(tl.float32)
        pos = tl.load(pos_ptr + rows, mask=m_ok, other=0).to(tl.int32)  # [M]

        # keys any row of the tile reads: [lo_k, hi_k); no row: hi_k = 0, nothing walked
        hi_k = tl.minimum(tl.max(tl.where(m_ok, pos, -1), axis=0) + 1, key_width)
        if HAS_WINDOW:
            lo_k = tl.maximum(tl.min(tl.where(m_ok, pos, key_width), axis=0) - window + 1, 0)
        else:
            lo_k = hi_k * 0
        table = table_ptr + b.to(tl.int64) * s_tb
        k_head = k_ptr + kvh.to(tl.int64) * s_kh
        v_head = v_ptr + kvh.to(tl.int64) * s_vh

        m_i = tl.full((BLOCK_M * BLOCK_G,), float("-inf"), dtype=tl.float32)  # running max, log2 units
        l_i = tl.zeros((BLOCK_M * BLOCK_G,), dtype=tl.float32)  # running sum of exp2(x - m)
        acc = tl.zeros((BLOCK_M * BLOCK_G, BLOCK_DV), dtype=tl.float32)  # running sum of exp2(x - m) v
        n0 = lo_k
        while n0 < hi_k:
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_ok = offs_n < hi_k
            blk = tl.load(table + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
            off = (offs_n % PAGE).to(tl.int64)
            k = tl.load(k_head + (blk * s_kb + off * s_kr)[:, None] + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BN, BD]
            if QUANT:  # codes times their block's per-channel scales: dequantised as they are loaded
                ksc = tl.load(ks_ptr + kvh.to(tl.int64) * s_ksh + (blk * s_ksb)[:, None] + offs_d[None, :],
                              mask=n_ok[:, None] & d_ok[None, :], other=0.0)
                k = k.to(tl.float32) * ksc.to(tl.float32)
                if not DOT_F32:
                    k = k.to(dt)
            if DOT_F32:
                k = k.to(tl.float32)
            x = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, BN] fp32
            ok = n_ok[None, :] & (offs_n[None, :] <= pos[:, None]) & m_ok[:, None]
            if HAS_WINDOW:
                ok = ok & (offs_n[None, :] > pos[:, None] - window)
            x = tl.where(ok, x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: any finite shift gives p = 0
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(x - m_use[:, None])  # [M, BN]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + (blk * s_vb + off * s_vr)[:, None] + offs_dv[None, :],
                        mask=n_ok[:, None] & dv_ok[None, :], other=0.0)  # [BN, BDV]
            if QUANT:  # a value row's scale folds into its softmax weight: p (v s) = (p s) v
                vsc = tl.load(vs_ptr + blk * s_vsb + off * s_vsr + kvh, mask=n_ok, other=0.0).to(tl.float32)
                p_dot = (p * vsc[None, :]).to(dt)
                v = v.to(tl.float32 if DOT_F32 else dt)  # (the interpreter casts int8 to bf16 wrongly)
            else:
                p_dot = p.to(dt)
            if DOT_F32:
                v, p_dot = v.to(tl.float32), p_dot.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p_dot, v, input_precision=PRECISION)
            m_i = m_new
            n0 += BLOCK_N

        o = softmax_out(acc, m_i, l_i, sink_ptr, heads, m_ok, HAS_SINK)  # the sink joins the denominator
        tl.store(o_ptr + rows[:, None] * s_ot + heads[:, None] * s_oh + offs_dv[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])


def _pool_refusal(pool, what: str, per_channel: bool) -> str | None:
    """``paged_pool_refusal`` for a [num_blocks, block_size, Hkv, D] pool (judged on one head's 3-d view); a
    quantised one must keep its scales as the cache writes them: keys per channel per block ([num_blocks, Hkv,
    D]), values per token row ([num_blocks, block_size, Hkv])."""
    if isinstance(pool, torch.Tensor):
        if pool.dim() != 4:
            return f"the {what} pool must be [num_blocks, block_size, Hkv, D], not {tuple(pool.shape)}"
        return paged_pool_refusal(pool[:, :, 0], what)
    data, scale = getattr(pool, "data", None), getattr(pool, "scale", None)
    if data is None or data.dim() != 4 or getattr(pool, "per_channel", None) is not per_channel:
        return f"quantised {what} pools with {'per-token' if per_channel else 'per-channel'} scales are read by the PyTorch path"
    want = (data.shape[0], *data.shape[2:]) if per_channel else data.shape[:3]
    if data.stride(-1) != 1 or tuple(scale.shape) != tuple(want) or not scale.is_contiguous():
        return f"the quantised {what} pool's codes and scales must be contiguous, the scales {tuple(want)}"
    if pool.out_dtype == torch.float32 and data.device.type == "cuda":
        return f"quantised {what} pools of an fp32 model: the kernel's fp32 (IEEE) dots spill registers on the GPU"
    return None


def refusal(q: torch.Tensor, k_pool, v_pool, sinks: torch.Tensor | None = None,
            window: int | None = None) -> str | None:
    """Why :func:`paged_attention` cannot run ``q`` [T, H, Dqk] over these pools, or None when it can."""
    why = triton_refusal(q) or _pool_refusal(k_pool, "key", True) or _pool_refusal(v_pool, "value", False)
    if why is not None:
        return why
    if isinstance(k_pool, torch.Tensor) != isinstance(v_pool, torch.Tensor):
        return "one of the key and value pools is quantised, the other not"
    if q.dim() != 3:
        return f"q {tuple(q.shape)} is not [T, H, Dqk]"
    (k, _, _, k_dtype), (v, _, _, v_dtype) = pool_operands(k_pool), pool_operands(v_pool)
    H, Dqk = q.shape[1:]
    nb, bs, Hkv, Dk = k.shape
    Dv = v.shape[3]
    if tuple(v.shape[:3]) != (nb, bs, Hkv):
        return f"key pool {tuple(k.shape)} and value pool {tuple(v.shape)} differ in blocks or heads"
    if Dk != Dqk:
        return f"q heads of {Dqk} do not match key rows of {Dk}"
    if Hkv == 0 or H % Hkv:
        return f"{H} query heads are not a multiple of {Hkv} kv heads"
    if max(Dqk, Dv) > MAX_HEAD_DIM:
        return f"head dims {Dqk} / {Dv} exceed the kernel's {MAX_HEAD_DIM}"
    if not (q.dtype == k_dtype == v_dtype):
        return f"dtypes differ: q {q.dtype}, key pool {k_dtype}, value pool {v_dtype}"
    if q.device != k.device or q.device != v.device:
        return "q and the pools are on different devices"
    if sinks is not None and tuple(sinks.shape) != (H,):
        return f"sinks {tuple(sinks.shape)} are not [{H}]"
    if window is not None and not isinstance(window, int):
        return f"window {window!r} is not an int"
    return None


def tile_config(T: int, B: int, G: int, Dqk: int, Dv: int, block_m: int | None = None,
                block_n: int | None = None) -> tuple[int, int, int, int]:
    """(BLOCK_M rows, BLOCK_G heads, BLOCK_N keys, num_warps) from shapes only (a captured graph fixes them).
    BLOCK_M follows the mean rows per sequence (T / B: 1 in a decode step), within [MIN_M, MAX_M] (row, head)
    pairs; ``block_m`` / ``block_n`` override (tests)."""
    wide = max(Dqk, Dv) > 128
    max_m = MAX_M_WIDE if wide else MAX_M
    bg = min(next_pow2(G), max_m)
    mean_rows = math.ceil(T / max(B, 1))
    bm = block_m or min(next_pow2(mean_rows), max(1, max_m // bg))
    bm = max(next_pow2(bm), MIN_M // bg, 1)
    bn = block_n or (BLOCK_N_WIDE if wide else BLOCK_N)
    return bm, bg, max(16, next_pow2(bn)), 8 if bm * bg >= 128 else 4


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens: torch.Tensor, positions: torch.Tensor, block_size: int, scale: float,
                    sinks: torch.Tensor | None = None, window: int | None = None, *,
                    seq_of_row: torch.Tensor | None = None, block_m: int | None = None,
                    block_n: int | None = None) -> torch.Tensor:
    """[T, H, Dv] in q's dtype: causal GQA/MQA attention of every query row over its sequence's paged keys (see
    the module docstring). q: [T, H, Dqk]; pools: [num_blocks, block_size, Hkv, D]; block_tables: [B, W];
    cu_seqlens: [B+1] (device; cu_seqlens[B] = T); positions: [T]; sinks: [H] or None; window: keys per query
    (the query's own included) or None. Reads no device value on the host: capturable in a CUDA graph.
    ``seq_of_row`` is accepted for the batch-wide ops' calling convention and not needed (the tiles find their
    sequences in ``cu_seqlens``); ``block_m`` / ``block_n`` override the tile sizes (tests)."""
    T, H, Dqk = q.shape
    (k_pool, k_scale, quant, dtype), (v_pool, v_scale, _, _) = pool_operands(k_pool), pool_operands(v_pool)
    Hkv, Dv = v_pool.shape[2], v_pool.shape[3]
    G = H // Hkv
    B = cu_seqlens.shape[0] - 1
    key_width = block_tables.shape[1] * block_size
    out = torch.empty(T, H, Dv, dtype=q.dtype, device=q.device)
    if T == 0 or H == 0:
        return out
    if B <= 0 or key_width == 0:  # no key anywhere: the weights are 0 whatever the sink
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    cu_seqlens, positions = cu_seqlens.contiguous(), positions.contiguous()
    if sinks is not None:
        sinks = sinks.contiguous()
    bm, bg, bn, warps = tile_config(T, B, G, Dqk, Dv, block_m, block_n)
    bd = max(16, next_pow2(Dqk))
    # The value columns are padded to at least the key columns: with fewer (e.g. Dqk 40 / Dv 24 -> 64 / 32),
    # Triton 3.6 was seen to miscompile the bf16/fp16 wgmma path on an H200 (M >= 64 with 4 warps: wrong rows).
    bdv = max(16, next_pow2(Dv), bd)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(T, bm) + B, Hkv, triton.cdiv(G, bg))
    ks = (k_scale.stride(0), k_scale.stride(1), v_scale.stride(0), v_scale.stride(1)) if quant else (0, 0, 0, 0)
    _paged_attention_kernel[grid](
        q, k_pool, v_pool, k_scale, v_scale, out, block_tables, cu_seqlens, positions,
        sinks if sinks is not None else q, B, G, key_width, 0 if window is None else window, scale * LOG2E,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), *ks, out.stride(0), out.stride(1),
        block_tables.stride(0), DQK=Dqk, DV=Dv, PAGE=block_size, HAS_WINDOW=window is not None,
        HAS_SINK=sinks is not None, BLOCK_M=bm, BLOCK_G=bg, BLOCK_N=bn, BLOCK_D=bd, BLOCK_DV=bdv,
        DOT_F32=DOT_F32, PRECISION=precision, QUANT=quant, DT=TORCH_TO_TL[dtype], num_warps=warps, num_stages=2,
        **pdl(q))
    return out
