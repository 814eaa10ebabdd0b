"""Triton kernels of the grouped expert MLP: the tile schedule, weight tiles per format, and the two GEMMs.

Rows arrive sorted by expert (``moe_permute``), expert e owning rows ``offsets[e-1]:offsets[e]``. Every
program finds its own (expert, row tile) from ``offsets`` on the device (:func:`_tile`), so the launch grid is
a fixed upper bound known from shapes alone and nothing is read back to the host: the op can be captured
in a CUDA graph and replayed with other offsets. Programs past the real tiles return at once (the second
kernel's idle programs zero the padding rows past ``offsets[-1]`` instead, so every output row is finite).

Weights are read in their stored format and dequantised in the K loop, never copied whole:
``PLAIN`` (bf16/fp16/fp32), ``TILE`` (e4m3 with one fp32 scale per 128x128 tile: the tile scale is constant
over a BLOCK_K step, so it multiplies the partial product and the codes enter the dot exactly), ``BLOCK``
(e4m3 with one fp32 scale per 32 weights along K) and ``MXFP4`` (E2M1 nibble pairs with E8M0 scales per 32).
The dots take operands in the activations' dtype (bf16 tensor cores on a GPU) and accumulate in fp32. With
ACT_FP8 (TILE weights) the activations arrive as e4m3 codes with one scale per row per 128 columns, written by
``quantize_groups_kernel`` before each GEMM, and the dot is FP8 x FP8 with both operands read from memory; the
row and tile scales multiply the partial product of each 128-wide K step.

L and I are constexpr: the K loops get constant trip counts (and one compile per layer shape), and Triton's
interpreter (numpy 2.4) cannot ``range()`` over runtime ints. N stays a runtime argument, unspecialised, so a
new row count (a new CUDA-graph batch size) never recompiles. Importing this module needs Triton;
``triton_moe`` imports it only when Triton is there.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dayzero.ops.triton_support import grid_dependency, round_e4m3

# weight formats (FMT) and activations (ACT): constexpr globals, the only kind a kernel may read
PLAIN, TILE, BLOCK, MXFP4 = map(tl.constexpr, range(4))
SILU, RELU2, SWIGLU_OAI = map(tl.constexpr, range(3))
# twice the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 -> 0, 1, 2, 3, 4, 6, 8, 12, one nibble each (0xC8643210
# as a signed int32): a register lookup table, exact, with no subnormal arithmetic
_E2M1_X2 = tl.constexpr(-932957680)


@triton.jit
def _tile(offs_ptr, E, N, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Row tile ``pid_m`` of the schedule: expert e has cdiv(count_e, BLOCK_M) tiles, experts in order.

    Returns (expert, first row, end row of the expert, number of tiles, rows in all = offsets[-1]); the
    expert is E or more when ``pid_m`` is past the last tile."""
    idx = tl.arange(0, E_POW2)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)  # [E_POW2]
    starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)  # inclusive: tiles of experts 0..e
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)  # first expert whose tiles reach past pid_m
    mine = idx == expert
    first_tile = tl.sum(tl.where(mine, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(mine, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    row_end = tl.minimum(tl.sum(tl.where(mine, ends, 0), 0), N)
    rows_total = tl.load(offs_ptr + E - 1)
    return expert, row0, row_end, tl.sum(tiles, 0), rows_total


@triton.jit
def _swizzle(pid, m_tiles, N_COLS: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (row tile, column tile), GROUP_M row tiles at a time across every column tile, so the
    programs running together share their rows' x tiles and one expert's weights in L2."""
    per_group = GROUP_M * N_COLS
    first = (pid // per_group) * GROUP_M
    size = tl.minimum(m_tiles - first, GROUP_M)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _e8m0_half(s):
    """E8M0 scale bytes -> half their value, 2^(s-128) in fp32 (0xFF -> NaN); s <= 1 flushes to zero (a
    subnormal scale, 2^-126 or below, that no checkpoint uses)."""
    s = s.to(tl.int32)
    v = (tl.maximum(s - 1, 0) << 23).to(tl.float32, bitcast=True)
    return tl.where(s == 255, float("nan"), v)


@triton.jit
def _e2m1_x2(code):
    """E2M1 codes (int32, 0..15; 8..15 negative) -> twice their value as int32."""
    mag = (_E2M1_X2 >> ((code & 7) * 4)) & 15
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def weight_rows(w_ptr, s_ptr, w_row, s_row, n_ok, k0, K, s_wk, s_sk,
                 FMT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Columns k0..k0+BLOCK_K of the weight rows starting at element offsets ``w_row`` [ROWS] (their scales' rows
    at ``s_row``) as [ROWS, BLOCK_K] in ``dtype``, dequantised; for TILE the raw codes (the caller scales the
    product). Rows may belong to different experts. Masked entries are 0."""
    if FMT == BLOCK or FMT == MXFP4:
        g = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # [G]: the 32-blocks of this K step
        ok = n_ok[:, None] & (g[None, :] < K // 32)  # [ROWS, G]
        s = tl.load(s_ptr + s_row[:, None] + g[None, :] * s_sk, mask=ok, other=0)
        if FMT == BLOCK:
            j = tl.arange(0, 32)
            ptr = w_ptr + w_row[:, None, None] + (g[None, :, None] * 32 + j[None, None, :]) * s_wk
            codes = tl.load(ptr, mask=ok[:, :, None], other=0.0)  # [ROWS, G, 32] e4m3
            w = codes.to(tl.float32) * s[:, :, None]
        else:
            j = tl.arange(0, 16)
            ptr = w_ptr + w_row[:, None, None] + (g[None, :, None] * 16 + j[None, None, :]) * s_wk
            byte = tl.load(ptr, mask=ok[:, :, None], other=0).to(tl.int32)  # [ROWS, G, 16]: elements 2j, 2j+1
            pair = tl.join(_e2m1_x2(byte & 15), _e2m1_x2(byte >> 4))  # [ROWS, G, 16, 2]
            w = pair.to(tl.float32) * _e8m0_half(s)[:, :, None, None]
        w = tl.reshape(w, (ROWS, BLOCK_K))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + w_row[:, None] + k[None, :] * s_wk, mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
    return w.to(dtype)


@triton.jit
def weight_tile(w_ptr, s_ptr, e, n, n_ok, k0, K, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                 FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, dtype: tl.constexpr):
    """Weight rows ``n`` [BLOCK_N], columns k0..k0+BLOCK_K of expert e as [BLOCK_N, BLOCK_K] (:func:`weight_rows`)."""
    return weight_rows(w_ptr, s_ptr, e * s_we + n * s_wn, e * s_se + n * s_sn, n_ok, k0, K, s_wk, s_sk,
                        FMT, BLOCK_N, BLOCK_K, dtype)


@triton.jit
def quantize_rows(x, ROUND_FIRST: tl.constexpr):
    """Activations [R, 128] (one group a row) as e4m3 codes x / s and each row's scale s = amax / 448
    (``quantize_activations``, bit for bit). ROUND_FIRST: under Triton's interpreter (``round_e4m3``)."""
    xf = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(xf), 1), 1e-10)  # [R]
    # correctly rounded divisions, as torch's tensor ones: a near-tie must round the same way in both
    s = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    z = tl.minimum(tl.maximum(tl.math.div_rn(xf, s[:, None]), -448.0), 448.0)
    if ROUND_FIRST:
        z = round_e4m3(z)
    return z.to(tl.float8e4nv), s


@triton.jit
def fake_quantize_rows(v, ACT_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """With ACT_FP8, fp32 rows [R, 128] through e4m3 and back (:func:`quantize_rows`); else v."""
    if ACT_FP8:
        q, s = quantize_rows(v, ROUND_FIRST)
        v = q.to(tl.float32) * s[:, None]
    return v


@triton.jit
def group_scales(s_ptr, rows, s_sm, row_ok, k0, BLOCK_M: tl.constexpr, ACT_FP8: tl.constexpr):
    """With ACT_FP8, the scales [BLOCK_M] of ``rows``' activation codes in the 128-wide K step at k0; else ones."""
    if ACT_FP8:
        s = tl.load(s_ptr + rows * s_sm + k0 // 128, mask=row_ok, other=0.0)
    else:
        s = tl.full((BLOCK_M,), 1.0, tl.float32)
    return s


@triton.jit(do_not_specialize=["R"])
def quantize_groups_kernel(x_ptr, q_ptr, s_ptr, R, K: tl.constexpr, s_xm, s_xk, s_qm, s_sm, BLOCK_R: tl.constexpr,
                           ROUND_FIRST: tl.constexpr, PDL: tl.constexpr):
    """Rows x [R, K] as e4m3 codes q [R, K] and one scale (amax / 448) per row per 128 columns s [R, cdiv(K,
    128)], by :func:`quantize_rows`: what the expert GEMMs with FP8 activations read, so
    their dots take both operands from memory. Grid: cdiv(R, BLOCK_R) x cdiv(K, 128)."""
    grid_dependency(PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    k = tl.program_id(1) * 128 + tl.arange(0, 128)
    ok = (rows < R)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * s_xm + k[None, :] * s_xk, mask=ok, other=0.0)
    q, s = quantize_rows(x, ROUND_FIRST)
    tl.store(q_ptr + rows[:, None] * s_qm + k[None, :], q, mask=ok)
    tl.store(s_ptr + rows * s_sm + tl.program_id(1), s, mask=rows < R)


@triton.jit
def _mma(acc, x, sx, w_ptr, s_ptr, e, n, n_ok, k0, K, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
         FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
         PRECISION: tl.constexpr, ACT_FP8: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x [BLOCK_M, BLOCK_K] @ W[e, n, k0:k0+BLOCK_K]^T, in fp32. With ACT_FP8 (TILE
    weights only) x holds e4m3 codes with row scales ``sx`` (``quantize_groups_kernel``) and the dot is FP8 x FP8."""
    w = weight_tile(w_ptr, s_ptr, e, n, n_ok, k0, K, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                     FMT, BLOCK_N, BLOCK_K, x.dtype)
    a, b = x, tl.trans(w)  # b: [BLOCK_K, BLOCK_N]
    if DOT_F32:  # Triton's interpreter multiplies 16-bit and 8-bit dot operands wrongly
        a, b = a.to(tl.float32), b.to(tl.float32)
    if FMT == TILE:  # one scale per 128x128 tile: constant over this K step (BLOCK_K divides 128)
        s = tl.load(s_ptr + e * s_se + (n // 128) * s_sn + (k0 // 128) * s_sk, mask=n_ok, other=0.0)
        if ACT_FP8:
            acc += tl.dot(a, b, input_precision=PRECISION) * sx[:, None] * s[None, :]
        else:
            acc += tl.dot(a, b, input_precision=PRECISION) * s[None, :]
    else:
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def activate(a, b, limit, ACT: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """The expert activation on fp32 pre-activations: a = gate (or the only half for relu2), b = up."""
    if ACT == RELU2:
        r = tl.maximum(a, 0.0)
        h = r * r
    elif ACT == SILU:
        if HAS_LIMIT:
            a = tl.minimum(a, limit)
            b = tl.minimum(tl.maximum(b, -limit), limit)
        h = a * tl.sigmoid(a) * b
    else:  # swiglu_oai (gpt-oss): alpha 1.702, limit 7
        a = tl.minimum(a, 7.0)
        b = tl.minimum(tl.maximum(b, -7.0), 7.0)
        h = a * tl.sigmoid(1.702 * a) * (b + 1.0)
    return h


@triton.jit(do_not_specialize=["N", "m_tiles", "limit"])
def moe_up_kernel(x_ptr, xs_ptr, ord_ptr, offs_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, limit, N, m_tiles, L: tl.constexpr,
                  I: tl.constexpr, E, s_xm, s_xk, s_xsm, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn, s_hm,
                  FMT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HAS_LIMIT: tl.constexpr, GATHER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_POW2: tl.constexpr,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr, ACT_FP8: tl.constexpr = False):
    """h[rows, cols] = act(x[rows] @ w1[e]^T + b1[e]) for one row tile of expert e and BLOCK_N columns of I.

    Gated activations keep two accumulators, gate rows ``cols`` and up rows ``I + cols`` of w1, so h is
    written [N, I] and never [N, 2I]. h is stored in the dtype of its pointer (the activations' dtype). With
    GATHER, x holds the tokens and sorted row r is token ord[r] // TOP_K. With ACT_FP8, x holds e4m3 codes and
    xs their scales per 128 columns (``quantize_groups_kernel``)."""
    # x: [N, L] (GATHER: [T, L]); w1: [E, r*I, L]; b1: [E, r*I]; h: [N, I]; grid: m_tiles x cdiv(I, BLOCK_N)
    grid_dependency(PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), m_tiles, tl.cdiv(I, BLOCK_N), GROUP_M)
    e, row0, row_end, n_tiles, _ = _tile(offs_ptr, E, N, pid_m, BLOCK_M, E_POW2)
    if pid_m < n_tiles:
        ex = e.to(tl.int64)  # E * (r*I) * L can pass 2^31
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows = rows.to(tl.int64)
        src = rows  # the rows of x this tile reads
        if GATHER:
            src = (tl.load(ord_ptr + rows, mask=row_ok, other=0) // TOP_K).to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        acc_a = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # gate (or relu2's only) half
        acc_b = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # up half
        for k0 in range(0, L, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + src[:, None] * s_xm + k[None, :] * s_xk,
                        mask=row_ok[:, None] & (k[None, :] < L), other=0.0)  # [BLOCK_M, BLOCK_K]
            sx = group_scales(xs_ptr, src, s_xsm, row_ok, k0, BLOCK_M, ACT_FP8)
            acc_a = _mma(acc_a, x, sx, w_ptr, ws_ptr, ex, cols, col_ok, k0, L, s_we, s_wn, s_wk, s_se, s_sn,
                         s_sk, FMT, BLOCK_N, BLOCK_K, DOT_F32, PRECISION, ACT_FP8)
            if GATED:
                acc_b = _mma(acc_b, x, sx, w_ptr, ws_ptr, ex, cols + I, col_ok, k0, L, s_we, s_wn, s_wk, s_se,
                             s_sn, s_sk, FMT, BLOCK_N, BLOCK_K, DOT_F32, PRECISION, ACT_FP8)
        if HAS_BIAS:
            acc_a += tl.load(b_ptr + ex * s_be + cols * s_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_b += tl.load(b_ptr + ex * s_be + (cols + I) * s_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = activate(acc_a, acc_b, limit, ACT, HAS_LIMIT)
        tl.store(h_ptr + rows[:, None] * s_hm + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["N", "m_tiles"])
def moe_down_kernel(h_ptr, hs_ptr, offs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, N, m_tiles, L: tl.constexpr, I: tl.constexpr,
                    E, s_hm, s_hsm, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn, s_ym,
                    FMT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, E_POW2: tl.constexpr, DOT_F32: tl.constexpr,
                    PRECISION: tl.constexpr, PDL: tl.constexpr, ACT_FP8: tl.constexpr = False):
    """y[rows, cols] = h[rows] @ w2[e]^T + b2[e] for one row tile of expert e and BLOCK_N columns of L.

    The programs past the real tiles share the zeroing of the padding rows offsets[-1]:N between them. With
    ACT_FP8, h holds e4m3 codes and hs their scales per 128 columns."""
    # h: [N, I]; w2: [E, L, I]; b2: [E, L]; y: [N, L]; grid: m_tiles (a bound) x cdiv(L, BLOCK_N) programs
    grid_dependency(PDL)
    pid_m, pid_n = _swizzle(tl.program_id(0), m_tiles, tl.cdiv(L, BLOCK_N), GROUP_M)
    e, row0, row_end, n_tiles, rows_total = _tile(offs_ptr, E, N, pid_m, BLOCK_M, E_POW2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < L
    if pid_m >= n_tiles:  # idle: take a stride of the padding rows
        step = (m_tiles - n_tiles) * BLOCK_M
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
        r0 = rows_total + (pid_m - n_tiles) * BLOCK_M
        while r0 < N:  # a while: the interpreter cannot range() over runtime bounds, and nothing here is pipelined
            rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :], zero, mask=(rows < N)[:, None] & col_ok[None, :])
            r0 += step
    else:
        ex = e.to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows = rows.to(tl.int64)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            h = tl.load(h_ptr + rows[:, None] * s_hm + k[None, :], mask=row_ok[:, None] & (k[None, :] < I), other=0.0)
            sh = group_scales(hs_ptr, rows, s_hsm, row_ok, k0, BLOCK_M, ACT_FP8)
            acc = _mma(acc, h, sh, w_ptr, ws_ptr, ex, cols, col_ok, k0, I, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                       FMT, BLOCK_N, BLOCK_K, DOT_F32, PRECISION, ACT_FP8)
        if HAS_BIAS:
            acc += tl.load(b_ptr + ex * s_be + cols * s_bn, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * s_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
