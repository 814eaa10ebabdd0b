"""Per-head products of a decode step's few rows as one Triton launch: MLA's absorbed query and its output.

Absorbed MLA multiplies each head's rows by that head's slice of ``kv_b_proj`` twice a layer: q~ = q_nope · W_UK
before the attention ([T, H, N] by [H, N, R]) and o = o_lat · W_UVᵀ after it ([T, H, R] by [H, V, R]ᵀ). As
einsums these are batched cuBLAS GEMMs, and at a decode step's one to eight rows each is a matrix-vector product
per head, bound by reading the 2 MB of weights (dayzero-small: 16 heads of 128 x 512). A cuBLAS kernel also
leaves the programmatic-dependent-launch chain of the step's Triton kernels: it starts only after the kernel
before it has finished, and the kernel after it too, so neither overlaps its start with the other's end.

:func:`head_product` computes ``y[t, h, j] = Σ_i x[t, h, i] · w[h, i, j]`` for any strides of w, with one program
per (head, block of output columns j) holding its whole slice of the head's weight when it fits one tile
(:data:`TILE` elements): a model weight (``PRELOAD``) is then read entirely before the wait for the kernel
before, and after it a program reads its head's rows of x (a few KB), multiplies in fp32 and stores. The tile's
layout follows the weight's unit stride: rows of outputs with the reduction contiguous (W_UV as stored) or rows
of the reduction with the outputs contiguous (W_UK). Results are rounded to the output dtype once, as cuBLAS's
fp32-accumulating GEMM rounds them. With ``early`` (W_UK's product: q_nope is written by the query's projection,
two launches or more before) the rows are read and multiplied before the wait too, and after it a program stores.

:func:`merged_head_product` takes o_lat as the MLA split kernel left it, its splits' partial sums and (max, sum)
pairs, and merges a row's splits as it reads them (the merge kernel's arithmetic, ``triton_mla.merged_row``):
one launch fewer a layer, for reading [splits, R] fp32 partials where the product read R values of o_lat.
"""
from __future__ import annotations

import torch

from dayzero.ops.attention.triton_mla import Partials
from dayzero.ops.static import preload
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, tl, triton, triton_refusal

MAX_ROWS = 8  # a decode step's rows, each through the program's weight tile in turn
TILE = 4096  # weight elements a program holds per step (32 fp32 registers a thread at 4 warps)
TARGET_PROGRAMS = 256  # about two per SM of an H100 or H200
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:
    from dayzero.ops.attention.triton_mla import merged_row
    from dayzero.ops.static import weight_tile
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _step(acc, w, k, x_ptr, h, H, s_xm, s_xh, M, I, ml_ptr, sink_ptr, s_xs, dt, OUT_ROWS: tl.constexpr,
              BLOCK_M: tl.constexpr, MERGED: tl.constexpr, SPLITS: tl.constexpr, HAS_SINK: tl.constexpr,
              BLOCK_S: tl.constexpr):
        """acc [BLOCK_M, BLOCK_J] plus each row's columns ``k`` of x times the weight tile w ([BLOCK_J, k] when
        OUT_ROWS, else [k, BLOCK_J]) in fp32, a row at a time: the tile is held once, whatever the rows. MERGED: x
        is MLA's split partials, each row merged here (``merged_row``) and rounded to ``dt`` as the merge kernel
        stores it."""
        w = w.to(tl.float32)
        m = tl.arange(0, BLOCK_M)
        for r in tl.static_range(BLOCK_M):
            if MERGED:
                x = merged_row(x_ptr, ml_ptr, sink_ptr, r, h, H, k, (k < I) & (r < M), s_xm, s_xh, s_xs, SPLITS,
                               HAS_SINK, BLOCK_S).to(dt).to(tl.float32)
            else:
                x = tl.load(x_ptr + h * s_xh + r * s_xm + k, mask=(k < I) & (r < M), other=0.0).to(tl.float32)
            if OUT_ROWS:
                part = tl.sum(x[None, :] * w, axis=1)
            else:
                part = tl.sum(x[:, None] * w, axis=0)
            acc = tl.where((m == r)[:, None], acc + part[None, :], acc)
        return acc

    @triton.jit
    def early_rows(w_first, i, x_ptr, M, I, s_xm, s_xh, OUT_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_J: tl.constexpr):
        """The first weight step's products [BLOCK_M, BLOCK_J] of the program's head's rows, read before the wait
        for the kernel before: rows that kernel does not write (the caller's ``early``: MLA's q_nope, written by
        the query's projection two launches or more back)."""
        acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
        return _step(acc, w_first, i, x_ptr, tl.program_id(0), tl.num_programs(0), s_xm, s_xh, M, I, x_ptr, x_ptr,
                     0, tl.float32, OUT_ROWS, BLOCK_M, False, 1, False, 1)

    @triton.jit
    def _head_product_kernel(x_ptr, w_ptr, y_ptr, M, I, J, s_xm, s_xh, s_wh, s_wi, s_wj, s_ym, s_yh,
                             ml_ptr, sink_ptr, s_xs,
                             OUT_ROWS: tl.constexpr, EVEN_I: tl.constexpr, EVEN_J: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                             PRELOAD: tl.constexpr, PDL: tl.constexpr, MERGED: tl.constexpr = False,
                             SPLITS: tl.constexpr = 1, HAS_SINK: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
                             EARLY: tl.constexpr = False):
        # x: [M, H, I] (unit stride along I), or with MERGED MLA's partials [M, H, SPLITS, I] fp32 and their
        # (max, sum) [M, H, SPLITS, 2]; w: [H, I, J] (unit stride along I when OUT_ROWS, else along J);
        # y: [M, H, J] (unit stride along J); grid: (H, cdiv(J, BLOCK_J)).
        # OUT_ROWS: the weight tile is [BLOCK_J, BLOCK_I], a row per output column; else [BLOCK_I, BLOCK_J].
        # EARLY (with PRELOAD): x's rows are not written by the kernel before, so the first step runs before the wait.
        h = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
        i = tl.arange(0, BLOCK_I)
        w_head = w_ptr + h * s_wh
        if OUT_ROWS:
            w_rows = w_head + j[:, None] * s_wj
        else:
            w_rows = w_head + i[:, None] * s_wi
        if PRELOAD:
            if OUT_ROWS:
                w_first = weight_tile(w_rows, i, j < J, I, EVEN_I)
            else:
                w_first = weight_tile(w_rows, j, i < I, J, EVEN_J)
        if EARLY:
            acc = early_rows(w_first, i, x_ptr, M, I, s_xm, s_xh, OUT_ROWS, BLOCK_M, BLOCK_J)
        grid_dependency(PDL)
        m = tl.arange(0, BLOCK_M)
        m_ok, j_ok = m < M, j < J
        H = tl.num_programs(0)
        dt = y_ptr.dtype.element_ty
        if not EARLY:
            acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
            if PRELOAD:
                acc = _step(acc, w_first, i, x_ptr, h, H, s_xm, s_xh, M, I, ml_ptr, sink_ptr, s_xs, dt, OUT_ROWS,
                            BLOCK_M, MERGED, SPLITS, HAS_SINK, BLOCK_S)
        for i0 in range(BLOCK_I if PRELOAD else 0, I, BLOCK_I):
            k = i0 + i
            if OUT_ROWS:
                w = tl.load(w_rows + k[None, :], mask=j_ok[:, None] & (k < I)[None, :], other=0.0)
            else:
                w = tl.load(w_head + k[:, None] * s_wi + j[None, :], mask=(k < I)[:, None] & j_ok[None, :], other=0.0)
            acc = _step(acc, w, k, x_ptr, h, H, s_xm, s_xh, M, I, ml_ptr, sink_ptr, s_xs, dt, OUT_ROWS, BLOCK_M,
                        MERGED, SPLITS, HAS_SINK, BLOCK_S)
        tl.store(y_ptr + m[:, None] * s_ym + h * s_yh + j[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & j_ok[None, :])


def refusal(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why :func:`head_product` cannot take x [T, H, I] and w [H, I, J], or None."""
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dim() != 3 or w.dim() != 3 or x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        return f"x [rows, heads, I] and w [heads, I, J], got {tuple(x.shape)} and {tuple(w.shape)}"
    if not 0 < x.shape[0] <= MAX_ROWS:
        return f"{x.shape[0]} rows: the kernel takes 1 to {MAX_ROWS} (decode steps), a GEMM the rest"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"x and w of one dtype among bf16, fp16 and fp32, got {x.dtype} and {w.dtype}"
    if x.stride(2) != 1 or 1 not in (w.stride(1), w.stride(2)):
        return "x needs a unit stride along I and w along I or J"
    if max(w.numel(), x.numel()) >= 2 ** 31 or w.storage_offset() + w.stride(0) * w.shape[0] >= 2 ** 31:
        return "operands of 2^31 elements or more"
    return None


def blocks(rows: int, heads: int, i: int, j: int, programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(BLOCK_I, BLOCK_J): output columns per program so that heads x column blocks come to about ``programs``
    (4 to 64 columns), and a reduction step as long as keeps the weight tile at :data:`TILE` elements (the rows
    go through it one at a time, so their count does not shorten it)."""
    bj = max(4, min(64, next_pow2(max(1, heads * j // programs)), next_pow2(j)))
    bi = max(16, min(next_pow2(i), TILE // bj))
    return bi, bj


def head_product(x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, early: bool = False) -> torch.Tensor:
    """``y[t, h, j] = Σ_i x[t, h, i] · w[h, i, j]`` [T, H, J] in ``out_dtype`` (default x's), one launch (see
    :func:`refusal`). ``weight``: the tensor w is a view of, when that is a model weight: then each program reads
    its weight before waiting for the kernel before (its first tile: all of it at dayzero-small's shapes).
    ``early``: the caller vouches that the kernel launched just before this call does not write x, so with the
    weight read early each program multiplies its rows by that first tile before the wait too (at
    dayzero-small's shapes the whole product: after the wait a program only stores)."""
    return _launch(x, x.shape, x.stride(0), x.stride(1), w, weight, out_dtype or x.dtype, early=early)


def merged_head_product(parts: Partials, w: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`head_product` of MLA's o_lat given as its splits' partials (``triton_mla.mla_decode(...,
    merge=False)``), merged as each program reads its head's rows: the merge kernel's launch leaves the step. Each
    program reads its head's [splits, I] fp32 partials for a row, where it would read the row's I values; o_lat is
    rounded to ``parts.out``'s dtype before the product, as the merge kernel stores it, and so is y."""
    T, H, S, I = parts.o.shape
    return _launch(parts.o, (T, H, I), parts.o.stride(0), parts.o.stride(1), w, weight, parts.out.dtype, parts)


def _launch(x, shape, s_xm, s_xh, w, weight, out_dtype, parts: Partials | None = None,
            early: bool = False) -> torch.Tensor:
    T, H, I = shape
    J = w.shape[2]
    y = torch.empty(T, H, J, dtype=out_dtype, device=x.device)
    out_rows = w.stride(1) == 1
    bi, bj = blocks(T, H, I, J)
    merged = {}
    if parts is not None:
        S = parts.o.shape[2]
        merged = dict(MERGED=True, SPLITS=S, HAS_SINK=parts.sinks is not None, BLOCK_S=next_pow2(S))
    ml = parts.ml if parts is not None else x
    sinks = parts.sinks if parts is not None and parts.sinks is not None else ml
    options = preload(x, weight if weight is not None else w)
    options["EARLY"] = early and options["PRELOAD"] and parts is None  # the rows' step rides on the weight's
    _head_product_kernel[(H, triton.cdiv(J, bj))](
        x, w, y, T, I, J, s_xm, s_xh, w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1), ml, sinks,
        x.stride(2) if parts is not None else 0,
        OUT_ROWS=out_rows, EVEN_I=I % bi == 0, EVEN_J=J % bj == 0, BLOCK_M=next_pow2(T), BLOCK_I=bi, BLOCK_J=bj,
        num_warps=4, **merged, **options)
    return y
