"""Absorbed MLA over the paged latent pool as Triton kernels: split-K (flash-decoding) and a merge, for decode
rows and for the rows of prefill chunks alike (each query row attends on its own: its sequence's block table,
its position, its own selection).

The latent pool holds one shared key/value head per token, ``[c (R) | k_pe (P)]``: the key is the whole row,
the value its first R columns. For the absorbed query q~ = [q_nope W_UK | q_pe] ([B, H, R+P], its two parts
computed in torch by ``paged_mla_rows`` and read apart) every head h of decode row b gets

    o_lat[b, h] = sum_j softmax_j(scale * q~[b, h] . lat_j) c_j      (fp32; a sink adds e^sink to the sum)

over its keys j: the DSA ``selection`` [B, topk] (key positions, -1 = none), or with no selection every
position 0..positions[b] of its block table. Row b reads the block table of sequence ``seq_of_row[b]`` (the
rows of a prefill chunk share their sequence's), or row b of the tables when there is no map (decode). A key counts only if 0 <= position <= positions[b] (and inside
the table); other rows are never loaded (masked loads), since a stale row of a reused block may hold inf/NaN.

- split kernel: one program per (row, split of the key list, block of heads). It walks its split in tiles of
  keys gathered through the block table, keeps a running max / sum / [heads, R] output in fp32 (log2 domain,
  so exp2), and writes them as partials. With ``early`` its first tile is read before the wait for the kernel
  before (the absorbed query's product, which writes only q~), so the table -> latent round trip of a decode
  step's one-tile splits is off the chain. The latent tile is loaded once as [keys, R] + [keys, P] (R=512 and
  P=64 in the real model, so R+P=576 needs no padding to 1024) and serves as both the key and the value.
- merge kernel: one program per (row, head, slice of R) rescales the splits' partials to their common max, adds
  the sink to the denominator and writes o_lat [B, H, R] (fp32, or the model's dtype for the product that
  follows). A decode step's few rows skip it: the output product merges the partials as it reads them
  (``merge=False``, :func:`~dayzero.ops.attention.head_kernels.merged_head_product`). With one split (every
  prefill row: there are rows enough to fill the device) the split kernel normalises and writes o_lat itself,
  with no partials.

The number of splits is chosen on the host from shapes only (rows, heads, key-list length), never from a
device value: both kernels run inside captured CUDA graphs. Dots run in the pool's dtype on the tensor cores
(q~ is cast to it), with fp32 accumulation; fp32 pools use IEEE fp32 dots. A quantised pool (``kv_cache_dtype``
fp8 / int8: codes with one scale per token row) is read as its codes, exact in the model's dtype, which the dots
take; a row's scale multiplies its scores and, folded into the softmax weights, its value.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from dayzero.ops.triton_support import (DOT_F32, HAS_TRITON, next_pow2, paged_pool_refusal, pdl, pool_operands, tl,
                                        triton, triton_refusal)

# Heads x keys per tile, and warps: at R=512 this compiles for sm_90 to 252 registers a thread and no spills
# (M=16 runs on mma.sync; 64 heads would reach wgmma but spill). Not tuned on a GPU yet.
BLOCK_H, BLOCK_N, NUM_WARPS = 16, 32, 8
MERGE_BLOCK_R = 128  # latent columns per merge program
TARGET_PROGRAMS = 264  # about two waves of an H200's 132 SMs
MIN_SPLIT_KEYS = 128  # past this many heads' worth, fewer keys per split spend more on partials than on the keys
MAX_SPLITS = 64
MAX_RANK = 1024  # R + P up to this
LOG2E = 1.4426950408889634

if HAS_TRITON:
    from dayzero.ops.triton_support import TORCH_TO_TL, grid_dependency, softmax_out

    @triton.jit
    def key_tile(n0, end, b, pos, table, sel_ptr, lat_ptr, ls_ptr, key_width, s_sb, s_lb, s_lr, s_lsb,
                 R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr, SPARSE: tl.constexpr, QUANT: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """Row b's keys n0 .. n0 + BLOCK_N of its split (ending at ``end``): which count (``valid``: inside the split
        and the table, at or before the row's position; other rows are never loaded, since a stale row of a reused
        block may hold inf/NaN), their latent rows' R and P columns [BN, BR] and [BN, BP] as stored, and with a
        quantised pool their scales (else ``valid`` as fp32, unread)."""
        offs_n = n0 + tl.arange(0, BLOCK_N)
        inside = offs_n < end
        if SPARSE:
            kp = tl.load(sel_ptr + b * s_sb + offs_n, mask=inside, other=-1)
        else:
            kp = offs_n
        valid = inside & (kp >= 0) & (kp <= pos) & (kp < key_width)  # [BN]
        blk = tl.load(table + kp // PAGE, mask=valid, other=0).to(tl.int64)
        row = lat_ptr + blk * s_lb + (kp % PAGE).to(tl.int64) * s_lr  # [BN] row pointers
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        kc = tl.load(row[:, None] + offs_r[None, :], mask=valid[:, None] & (offs_r < R)[None, :], other=0.0)
        kr = tl.load(row[:, None] + R + offs_p[None, :], mask=valid[:, None] & (offs_p < P)[None, :], other=0.0)
        if QUANT:
            sc = tl.load(ls_ptr + blk * s_lsb + kp % PAGE, mask=valid, other=0.0).to(tl.float32)
        else:
            sc = valid.to(tl.float32)
        return valid, kc, kr, sc

    @triton.jit
    def attend_keys(m, l, acc, q_c, q_p, valid, kc, kr, sc, qk_scale, dt: tl.constexpr, DOT_F32: tl.constexpr,
                    QUANT: tl.constexpr, PRECISION: tl.constexpr):
        """The online softmax's running max ``m``, sum ``l`` and output ``acc`` [BH, BR] after a tile of keys
        (:func:`key_tile`); the dots in ``dt`` (fp32 with DOT_F32) with fp32 accumulation, the latent row serving
        as both key and value."""
        if DOT_F32:  # (the interpreter also casts int8 codes to bf16 wrongly; to fp32 they are exact)
            kc, kr = kc.to(tl.float32), kr.to(tl.float32)
        elif QUANT:
            kc, kr = kc.to(dt), kr.to(dt)
        s = tl.dot(q_c, tl.trans(kc), input_precision=PRECISION)
        s += tl.dot(q_p, tl.trans(kr), input_precision=PRECISION)  # [BH, BN] fp32
        if QUANT:  # a row's scale factors out of its score and of its value: q.(c s) = (q.c) s, p (c s) = (p s) c
            s = s * sc[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: any finite shift gives p = 0
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])  # [BH, BN]
        l = l * alpha + tl.sum(p, axis=1)
        if QUANT:
            p_dot = (p * sc[None, :]).to(dt)
        else:
            p_dot = p.to(dt)
        if DOT_F32:
            p_dot = p_dot.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_dot, kc, input_precision=PRECISION)  # value = c
        return m_new, l, acc

    @triton.jit
    def first_keys(table_ptr, seq_ptr, pos_ptr, sel_ptr, lat_ptr, ls_ptr, num_keys, key_width, keys_per_split, s_tb,
                   s_sb, s_lb, s_lr, s_lsb, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr,
                   SPARSE: tl.constexpr, HAS_SEQ: tl.constexpr, QUANT: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        """The program's row, its position, block table and end of its split's keys, and the split's first tile
        (:func:`key_tile`). None of it is written by the kernel just before the split kernel (the step's inputs, and
        latent rows and a selection that the caller's ``early`` puts two kernels or more back), so with EARLY it is
        read before the wait, while that kernel still runs: the table -> latent round trip leaves the chain."""
        b = tl.program_id(0).to(tl.int64)  # partial offsets b * H * S * R may pass 2^31
        pos = tl.load(pos_ptr + b)
        if HAS_SEQ:
            table = table_ptr + tl.load(seq_ptr + b).to(tl.int64) * s_tb
        else:
            table = table_ptr + b * s_tb
        start = tl.program_id(1) * keys_per_split
        end = tl.minimum(start + keys_per_split, num_keys)
        if not SPARSE:  # dense: the keys are positions 0..pos, nothing past them to walk
            end = tl.minimum(end, pos + 1)
        valid, kc, kr, sc = key_tile(start, end, b, pos, table, sel_ptr, lat_ptr, ls_ptr, key_width, s_sb, s_lb, s_lr,
                                     s_lsb, R, P, PAGE, SPARSE, QUANT, BLOCK_R, BLOCK_P, BLOCK_N)
        return b, pos, table, start, end, valid, kc, kr, sc

    @triton.jit
    def _split_kernel(q_ptr, qp_ptr, lat_ptr, ls_ptr, table_ptr, seq_ptr, pos_ptr, sel_ptr, o_ptr, ml_ptr, sink_ptr,
                      H, num_keys, key_width, keys_per_split, qk_scale, s_qb, s_qh, s_qpb, s_qph, s_lb, s_lr, s_lsb,
                      s_tb, s_sb, s_ob, s_oh,
                      s_os, R: tl.constexpr, P: tl.constexpr, PAGE: tl.constexpr, SPARSE: tl.constexpr,
                      HAS_SEQ: tl.constexpr, FINAL: tl.constexpr, HAS_SINK: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr,
                      DT: tl.constexpr, EARLY: tl.constexpr = False):
        if EARLY:  # the first tile of keys while the kernel before runs (it writes only q~)
            b, pos, table, start, end, valid, kc, kr, sc = first_keys(
                table_ptr, seq_ptr, pos_ptr, sel_ptr, lat_ptr, ls_ptr, num_keys, key_width, keys_per_split, s_tb,
                s_sb, s_lb, s_lr, s_lsb, R, P, PAGE, SPARSE, HAS_SEQ, QUANT, BLOCK_R, BLOCK_P, BLOCK_N)
        grid_dependency(PDL)
        if not EARLY:
            b, pos, table, start, end, valid, kc, kr, sc = first_keys(
                table_ptr, seq_ptr, pos_ptr, sel_ptr, lat_ptr, ls_ptr, num_keys, key_width, keys_per_split, s_tb,
                s_sb, s_lb, s_lr, s_lsb, R, P, PAGE, SPARSE, HAS_SEQ, QUANT, BLOCK_R, BLOCK_P, BLOCK_N)
        split = tl.program_id(1)
        offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs_h < H
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        r_ok, p_ok = offs_r < R, offs_p < P
        # the dots' operand dtype: q~ and p are rounded to it (the model's dtype for quantised codes, exact in it)
        dt = DT if QUANT else lat_ptr.dtype.element_ty
        q_row = q_ptr + b * s_qb + offs_h[:, None] * s_qh  # q~'s latent columns, and its rope ones apart
        qp_row = qp_ptr + b * s_qpb + offs_h[:, None] * s_qph
        q_c = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0).to(dt)  # [BH, BR]
        q_p = tl.load(qp_row + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0).to(dt)  # [BH, BP]
        if DOT_F32:
            q_c, q_p = q_c.to(tl.float32), q_p.to(tl.float32)

        m = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)  # running max, log2 units
        l = tl.zeros((BLOCK_H,), dtype=tl.float32)  # running sum of exp2(s - m)
        acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)  # running sum of exp2(s - m) * c
        m, l, acc = attend_keys(m, l, acc, q_c, q_p, valid, kc, kr, sc, qk_scale, dt, DOT_F32, QUANT, PRECISION)
        n0 = start + BLOCK_N
        while n0 < end:  # a while loop: the interpreter cannot take device bounds in range()
            valid, kc, kr, sc = key_tile(n0, end, b, pos, table, sel_ptr, lat_ptr, ls_ptr, key_width, s_sb, s_lb,
                                         s_lr, s_lsb, R, P, PAGE, SPARSE, QUANT, BLOCK_R, BLOCK_P, BLOCK_N)
            m, l, acc = attend_keys(m, l, acc, q_c, q_p, valid, kc, kr, sc, qk_scale, dt, DOT_F32, QUANT, PRECISION)
            n0 += BLOCK_N
        if FINAL:  # one split: normalise here (the sink joins the denominator) and write o_lat, no merge
            acc = softmax_out(acc, m, l, sink_ptr, offs_h, h_ok, HAS_SINK)
        o = o_ptr + b * s_ob + offs_h[:, None] * s_oh + split * s_os + offs_r[None, :]
        tl.store(o, acc.to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])
        if not FINAL:
            ml = ml_ptr + ((b * H + offs_h) * tl.num_programs(1) + split) * 2
            tl.store(ml, m, mask=h_ok)
            tl.store(ml + 1, l, mask=h_ok)

    @triton.jit
    def merged_row(o_ptr, ml_ptr, sink_ptr, b, h, H, offs_r, ok, s_ob, s_oh, s_os, SPLITS: tl.constexpr,
                   HAS_SINK: tl.constexpr, BLOCK_S: tl.constexpr):
        """Row b's head h at latent columns ``offs_r`` (loaded where ``ok``) from the splits' partials, fp32: each
        split's sum rescaled to their common max, over the splits' denominator (the sink joins it; no key and no
        sink gives 0)."""
        offs_s = tl.arange(0, BLOCK_S)
        s_ok = offs_s < SPLITS
        ml = ml_ptr + ((b * H + h) * SPLITS + offs_s) * 2
        m_s = tl.load(ml, mask=s_ok, other=float("-inf"))  # [BS]
        l_s = tl.load(ml + 1, mask=s_ok, other=0.0)
        m = tl.max(m_s, axis=0)
        if HAS_SINK:
            sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634  # natural -> log2 units
            m = tl.maximum(m, sink)
        m = tl.where(m == float("-inf"), 0.0, m)  # no key and no sink: the output is 0
        wgt = tl.exp2(m_s - m)  # [BS]: 0 for splits without a key
        denom = tl.sum(l_s * wgt, axis=0)
        if HAS_SINK:
            denom += tl.exp2(sink - m)
        parts = o_ptr + b * s_ob + h * s_oh + offs_s[:, None] * s_os + offs_r[None, :]
        o = tl.sum(tl.load(parts, mask=s_ok[:, None] & ok[None, :], other=0.0) * wgt[:, None], axis=0)  # [BR]
        return o / tl.maximum(denom, 1.1754943508222875e-38)

    @triton.jit
    def _merge_kernel(o_ptr, ml_ptr, sink_ptr, out_ptr, H, s_ob, s_oh, s_os, s_xb, s_xh,
                      SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, R: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_R: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # a slice of R: [splits, slice] stays small
        r_ok = offs_r < R
        o = merged_row(o_ptr, ml_ptr, sink_ptr, b, h, H, offs_r, r_ok, s_ob, s_oh, s_os, SPLITS, HAS_SINK, BLOCK_S)
        tl.store(out_ptr + b * s_xb + h * s_xh + offs_r, o.to(out_ptr.dtype.element_ty), mask=r_ok)


def refusal(q_abs: torch.Tensor, latent_pool, selection: torch.Tensor | None = None) -> str | None:
    """Why the Triton MLA kernels cannot run ``q_abs`` [B, H, R+P] over ``latent_pool``, or None when they can."""
    return rows_refusal(q_abs, q_abs.shape, latent_pool, selection)


def rows_refusal(like: torch.Tensor, q_abs_shape, latent_pool, selection: torch.Tensor | None = None) -> str | None:
    """:func:`refusal` from the absorbed query's shape alone (``like``: any tensor on its device), so that a
    verifier can answer before q~ is computed."""
    why = triton_refusal(like) or paged_pool_refusal(latent_pool, "latent", quantised=True)
    if why is not None:
        return why
    width = pool_operands(latent_pool)[0].shape[-1]
    if len(q_abs_shape) != 3 or q_abs_shape[-1] != width:
        return f"q_abs {tuple(q_abs_shape)} does not match latent rows of width {width}"
    if q_abs_shape[-1] > MAX_RANK:
        return f"latent rows of {q_abs_shape[-1]} values exceed the kernel's {MAX_RANK}"
    if selection is not None and (selection.dim() != 2 or selection.shape[0] != q_abs_shape[0]):
        return f"selection {tuple(selection.shape)} is not [B, topk] for {q_abs_shape[0]} rows"
    return None


def num_splits(rows: int, heads: int, num_keys: int) -> int:
    """Splits of each row's key list: enough programs to fill the device, each with at least ``2 * heads`` keys
    (a split's fp32 partial of [heads, R] then weighs no more than its bf16 [keys, R + P] latent rows) and
    BLOCK_N, capped at MIN_SPLIT_KEYS. At a few rows and heads a split is then one tile of keys: a decode step of
    dayzero-small (16 heads, 512 tokens) walked 5 splits of 4 tiles each on 5 SMs, 17 us a layer. Shapes only
    (a captured graph fixes them), never a device value."""
    programs = max(1, rows) * math.ceil(heads / BLOCK_H)
    want = math.ceil(TARGET_PROGRAMS / programs)
    least = min(MIN_SPLIT_KEYS, max(BLOCK_N, 2 * heads))
    return max(1, min(want, math.ceil(num_keys / least), MAX_SPLITS))


def mla_decode(q_abs: torch.Tensor, latent_pool: torch.Tensor, block_tables: torch.Tensor, positions: torch.Tensor,
               block_size: int, rank: int, scale: float, sinks: torch.Tensor | None = None,
               selection: torch.Tensor | None = None, splits: int | None = None,
               seq_of_row: torch.Tensor | None = None, q_pe: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, early: bool = False,
               merge: bool = True) -> torch.Tensor | Partials:
    """o_lat [B, H, R] of absorbed MLA for B query rows (see the module docstring), accumulated in fp32 and
    written in ``out_dtype``; ``rank`` is R. ``q_pe`` [B, H, P]: q~'s rope columns, given apart (then ``q_abs``
    holds only its R latent columns, and no concatenation is needed). ``seq_of_row`` [B]: the row of
    ``block_tables`` each query row reads (None: row b reads row b, a decode step). ``splits`` overrides
    :func:`num_splits` (tests). ``early``: the caller vouches that the kernel launched just before this call writes
    none of the latent pool, its scales, the block tables, the positions, the row map or the selection (each
    written two launches back or more, as the absorbed query's product sits between them and this call), so that
    each program reads its first tile of keys before waiting for that kernel. ``merge=False``: where the rows' keys
    were split, the splits' :class:`Partials` rather than o_lat, for a kernel that merges them as it reads them
    (:func:`dayzero.ops.attention.head_kernels.merged_head_product`; :func:`merge_partials` otherwise)."""
    # q_abs: [B, H, R+P] (or [B, H, R] with q_pe); latent_pool: [num_blocks, block_size, R+P]; block_tables: [S, W]
    B, H = q_abs.shape[:2]
    R = rank
    if q_pe is None:
        q_abs, q_pe = q_abs[..., :R], q_abs[..., R:]
    P = q_pe.shape[-1]
    key_width = block_tables.shape[1] * block_size
    num_keys = key_width if selection is None else selection.shape[1]
    out = torch.empty(B, H, R, dtype=out_dtype, device=q_abs.device)
    if B == 0 or H == 0:
        return out
    if num_keys == 0:  # no key: the weights are 0 whatever the sink (it joins the denominator only)
        return out.zero_()
    q_abs, q_pe, block_tables = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_abs, q_pe, block_tables))
    if selection is not None and selection.stride(-1) != 1:
        selection = selection.contiguous()
    S = splits or num_splits(B, H, num_keys)
    per_split = math.ceil(math.ceil(num_keys / S) / BLOCK_N) * BLOCK_N
    S = math.ceil(num_keys / per_split)  # no split left empty by the rounding
    final = S == 1  # one split writes o_lat itself: no partials, no merge (every prefill row)
    part_o = out[:, :, None] if final else torch.empty(B, H, S, R, dtype=torch.float32, device=q_abs.device)
    part_ml = part_o if final else torch.empty(B, H, S, 2, dtype=torch.float32, device=q_abs.device)  # (max, sum)
    sel = selection if selection is not None else positions  # any pointer: never read when dense
    lat, lat_scale, quant, dtype = pool_operands(latent_pool)
    precision = "ieee" if dtype == torch.float32 else "tf32"
    BR, BP = max(16, next_pow2(R)), max(16, next_pow2(P))
    _split_kernel[(B, S, triton.cdiv(H, BLOCK_H))](
        q_abs, q_pe, lat, lat_scale, block_tables, positions if seq_of_row is None else seq_of_row, positions, sel,
        part_o, part_ml, sinks if sinks is not None else part_ml, H, num_keys, key_width, per_split,
        scale * LOG2E, q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), lat.stride(0), lat.stride(1),
        lat_scale.stride(0),
        block_tables.stride(0), sel.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        R=R, P=P, PAGE=block_size, SPARSE=selection is not None, HAS_SEQ=seq_of_row is not None, FINAL=final,
        HAS_SINK=sinks is not None, BLOCK_H=BLOCK_H, BLOCK_R=BR, BLOCK_P=BP, BLOCK_N=BLOCK_N, DOT_F32=DOT_F32,
        PRECISION=precision, QUANT=quant, DT=TORCH_TO_TL[dtype], EARLY=early, num_warps=NUM_WARPS, num_stages=2,
        **pdl(q_abs))
    if final:
        return out
    parts = Partials(part_o, part_ml, sinks, out)
    return merge_partials(parts) if merge else parts


class Partials(NamedTuple):
    """The split kernel's output where a row's keys were split: each split's unnormalised [R] sums and its (max,
    sum) per (row, head), the heads' sinks, and the buffer o_lat is merged into (its dtype is o_lat's)."""

    o: torch.Tensor  # [B, H, S, R] fp32
    ml: torch.Tensor  # [B, H, S, 2] fp32: running max (log2 units) and sum of exp2(s - max)
    sinks: torch.Tensor | None  # [H]
    out: torch.Tensor  # [B, H, R]


def merge_partials(p: Partials) -> torch.Tensor:
    """o_lat [B, H, R] from the splits' partials (the merge kernel), written into ``p.out``."""
    (B, H, S, R), out = p.o.shape, p.out
    BRM = min(max(16, next_pow2(R)), MERGE_BLOCK_R)
    _merge_kernel[(B, H, triton.cdiv(R, BRM))](
        p.o, p.ml, p.sinks if p.sinks is not None else p.ml, out, H, p.o.stride(0), p.o.stride(1), p.o.stride(2),
        out.stride(0), out.stride(1), SPLITS=S, HAS_SINK=p.sinks is not None, R=R, BLOCK_S=next_pow2(S),
        BLOCK_R=BRM, num_warps=4, **pdl(p.o))
    return out

