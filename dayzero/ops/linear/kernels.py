"""Linears of a few rows (decode steps) as one Triton kernel, chosen per shape against cuBLAS by timing.

At one to eight rows a projection is a matrix-vector product bound by reading its weight once. cuBLAS picks its
kernel per shape, and at some decode shapes it picks one that streams the weight far below the copy rate (on the
H200, dayzero-small's 2048 -> 1536 LatentMoE input projection ran as a 16x64-tile GEMM at 7.9 us, 20% of the
copy rate; its fp32 router GEMV as two kernels after a copy of the tokens to fp32, 6 us for 0.5 MB). The kernel
here gives each program ``BLOCK_N`` weight rows and walks K in ``BLOCK_K`` steps, accumulating every row of x in
fp32 at once (x is a few KB and stays in cache), reading x and the weight in their own dtypes and writing the
output dtype asked for.

Which runs is measured, not guessed: the first call of a (rows bucket, N, K, dtypes) key that is not inside a
CUDA-graph capture times cuBLAS and a few block shapes, each replayed in a CUDA graph (device time, not launch
time) over copies of the weight that together overflow the L2 cache, as a decode step reads them, and keeps the
fastest; a Triton shape must beat cuBLAS by :data:`MARGIN`. A key first met inside a capture, or on the CPU,
keeps cuBLAS (the reference). ``DAYZERO_OPS=linear=reference`` keeps cuBLAS everywhere.

The CUDA-core product holds an fp32 tile [rows, BLOCK_N, BLOCK_K] in registers, so its K steps, and the bytes a
program has in flight, shrink as rows grow: on the H200 it wins at one and two rows (1.8x on that projection, 2.8x
on the router) and read at 19-27% of the copy rate at four. For bf16 / fp16 operands and two rows or more the
choice also times tensor-core blocks (rows padded to 16, ``tl.dot`` per K step, several steps in flight), which
read at cuBLAS's rate or better at 2-8 rows (a decode step's projections 1.3x cuBLAS at four rows;
``benchmarks/decode_linear.py``, ``docs/performance.md``). The tensor-core blocks also take 9 to 64 rows (decode
steps of that many sequences), where cuBLAS's GEMMs read dayzero-small's projections at 50-63% of the copy rate;
there too the timing decides.
"""
from __future__ import annotations

import logging

import torch

from dayzero.ops.activation.kernels import RELU2, SILU, SWIGLU_OAI
from dayzero.ops.choices import tables as choice_tables
from dayzero.ops.static import is_static, mark_static, preload
from dayzero.ops.registry import register
from dayzero.ops.triton_support import DOT_F32, HAS_TRITON, next_pow2, pdl, triton_refusal

if HAS_TRITON:
    import triton
    import triton.language as tl

    from dayzero.ops.activation.kernels import activate
    from dayzero.ops.static import weight_tile
    from dayzero.ops.triton_support import grid_dependency

log = logging.getLogger("dayzero.ops")

MAX_ROWS = 8  # the CUDA-core product's rows: its fp32 tile grows with them (see the module docstring)
MAX_MMA_ROWS = 64  # the tensor-core blocks' rows (bf16 / fp16 operands): a decode step of up to 64 sequences
MARGIN = 0.95  # a Triton shape runs when it takes at most this share of cuBLAS's time
# activations the kernel applies to x as it reads it (``ACT``, the activation kernels' kind + 1): name -> (code,
# input columns per output column)
ACTS = {"silu": (SILU + 1, 2), "relu2": (RELU2 + 1, 1), "swiglu_oai": (SWIGLU_OAI + 1, 2)}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)

if HAS_TRITON:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, a_ptr, y_ptr, M, N, K, s_xm, s_wn, s_am, s_ym,
                       r_ptr, g_ptr, xn_ptr, ro_ptr, s_rm, eps, limit, alpha, q_ptr, s_qm,
                       x2_ptr, w2_ptr, K2, s_x2m, s_w2n, s_qh, s_qc, GV, s_xh,
                       HAS_BIAS: tl.constexpr, HAS_ADD: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                       ACT: tl.constexpr, CLAMP: tl.constexpr, HEAD: tl.constexpr, TWO: tl.constexpr,
                       SGATE: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
                       EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRELOAD: tl.constexpr, PDL: tl.constexpr):
        # x: [M, K], w: [N, K], add: [M, N] (unit column strides); y: [M, N]; grid: cdiv(N, BLOCK_N).
        # NORM: x is first RMS-normalised with weight g [K] (after adding the residual r [M, K] when HAS_RES,
        # rounded to x's dtype); the programs also write the normalised rows xn and the sum ro, both [M, K], a K
        # step each in turn. NORM 1: the scale factors out of the product (applied to the sums at the end); NORM
        # 2: a first pass over the rows takes their scale, and the product reads the normalised rows rounded to
        # x's dtype, exactly what the norm op writes (a high-precision product such as the router's reads them).
        # ACT (:data:`ACTS`): x holds the activation's input, [gate | up] rows [M, 2K] for the gated kinds, and the
        # product reads act(x) rounded to x's dtype, as the activation op would have written it.
        # HEAD > 0 (a power of two dividing BLOCK_K): x is [M, K / HEAD heads of HEAD], each head RMS-normalised
        # with weight g [HEAD] and multiplied by sigmoid of its gate q [M, K] (row stride s_qm), rounded to x's dtype.
        # TWO: a second product is added, x2 [M, K2] (ACT applying to it, not to x) times w2 [N, K2].
        # SGATE: x [M, K / GV heads of GV] (head h of row m at x + m * s_xm + h * s_xh, unit channel stride) times
        # sigmoid of its gate, column c of head h read at q + m * s_qm + h * s_qh + c * s_qc (s_qc = 0: one gate
        # per head), rounded to x's dtype.
        # DOT: each K step's product on the tensor cores (tl.dot, x's rows padded to BLOCK_M >= 16 and rounded to
        # the weight's dtype), its loads pipelined by the compiler; else on the CUDA cores in fp32.
        # PRELOAD: w (and w2) are written by no kernel of the step (model weights), so their first K steps are
        # read before the wait for the kernel before this one, while that one still runs.
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < N, m < M
        w_rows = w_ptr + n.to(tl.int64)[:, None] * s_wn
        x_rows = x_ptr + m[:, None] * s_xm
        w2_rows = w2_ptr + n.to(tl.int64)[:, None] * s_w2n
        if PRELOAD:
            w_first = weight_tile(w_rows, tl.arange(0, BLOCK_K), n_ok, K, EVEN_K)
            if TWO:  # the second product's first K step too: its weight is as static as the first's
                w2_first = weight_tile(w2_rows, tl.arange(0, BLOCK_K), n_ok, K2, False)
        grid_dependency(PDL)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if NORM == 2:  # the rows' scale first (a pass over them), so that the product reads the rounded rows
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                x = _norm_input(tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0),
                                r_ptr, m, k, s_rm, M, K, HAS_RES).to(tl.float32)
                ss += tl.sum(x * x, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        if PRELOAD:
            acc, ss = _k_step(acc, ss, rstd, w_first, tl.arange(0, BLOCK_K), x_rows, m, m_ok, M, K, s_xh, r_ptr, s_rm, g_ptr,
                              q_ptr, s_qm, s_qh, s_qc, GV, eps, limit, alpha, NORM, HAS_RES, ACT, CLAMP, HEAD, TWO,
                              SGATE, DOT, DOT_F32, EVEN_K, BLOCK_M, BLOCK_K)
        for k0 in range(BLOCK_K if PRELOAD else 0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = weight_tile(w_rows, k, n_ok, K, EVEN_K)
            acc, ss = _k_step(acc, ss, rstd, w, k, x_rows, m, m_ok, M, K, s_xh, r_ptr, s_rm, g_ptr, q_ptr, s_qm, s_qh, s_qc,
                              GV, eps, limit, alpha, NORM, HAS_RES, ACT, CLAMP, HEAD, TWO, SGATE, DOT, DOT_F32,
                              EVEN_K, BLOCK_M, BLOCK_K)
        if NORM == 1:
            rstd = tl.rsqrt(ss / K + eps)
            acc *= rstd[:, None]
        if NORM:
            # the normalised rows and the residual sum, for the layer's other readers: K steps dealt out to the
            # programs in turn (one program writing them all was a serial tail after the others had finished)
            for k0 in range(tl.program_id(0) * BLOCK_K, K, tl.num_programs(0) * BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                ok = m_ok[:, None] & (k < K)[None, :]
                x = _norm_input(tl.load(x_rows + k[None, :], mask=ok, other=0.0), r_ptr, m, k, s_rm, M, K,
                                HAS_RES)
                if HAS_RES:
                    tl.store(ro_ptr + m[:, None] * K + k[None, :], x, mask=ok)
                g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                xn = x.to(tl.float32) * rstd[:, None] * g[None, :]
                tl.store(xn_ptr + m[:, None] * K + k[None, :], xn.to(xn_ptr.dtype.element_ty), mask=ok)
        if TWO:
            x2_rows = x2_ptr + m[:, None] * s_x2m
            if PRELOAD:
                acc = _second_step(acc, w2_first, tl.arange(0, BLOCK_K), x2_rows, m_ok, K2, limit, alpha, ACT,
                                   CLAMP, DOT, DOT_F32)
            for k0 in range(BLOCK_K if PRELOAD else 0, K2, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                w = weight_tile(w2_rows, k, n_ok, K2, False)
                acc = _second_step(acc, w, k, x2_rows, m_ok, K2, limit, alpha, ACT, CLAMP, DOT, DOT_F32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_ADD:
            acc += tl.load(a_ptr + m[:, None] * s_am + n[None, :], mask=m_ok[:, None] & n_ok[None, :],
                           other=0.0).to(tl.float32)
        tl.store(y_ptr + m[:, None] * s_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


    @triton.jit
    def _k_step(acc, ss, rstd, w, k, x_rows, m, m_ok, M, K, s_xh, r_ptr, s_rm, g_ptr, q_ptr, s_qm, s_qh, s_qc, GV, eps, limit,
                alpha, NORM: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr, CLAMP: tl.constexpr,
                HEAD: tl.constexpr, TWO: tl.constexpr, SGATE: tl.constexpr, DOT: tl.constexpr, DOT_F32: tl.constexpr,
                EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
        """One K step of the first product: x's columns ``k`` read (through the prologue the flags ask for) and
        multiplied with the weight tile ``w`` [BLOCK_N, BLOCK_K] into acc; ss gathers the norm's sums of squares
        (NORM 1), or the rows are normalised by ``rstd`` and rounded to x's dtype first (NORM 2)."""
        xk = k
        if SGATE:  # heads side by side at any head stride
            xk = (k // GV) * s_xh + k % GV
        if EVEN_K:
            x = tl.load(x_rows + xk[None, :], mask=m_ok[:, None], other=0.0)
        else:
            x = tl.load(x_rows + xk[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
        if ACT != 0 and not TWO:
            x = _act_input(x, x_rows, k, m_ok, K, limit, alpha, ACT, CLAMP)
        if HEAD > 0:
            x = _gated_norm_input(x, q_ptr, g_ptr, m, k, s_qm, M, K, eps, HEAD, BLOCK_M, BLOCK_K)
        if SGATE:
            q = tl.load(q_ptr + m[:, None] * s_qm + (k // GV)[None, :] * s_qh + (k % GV)[None, :] * s_qc,
                        mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * tl.sigmoid(q)).to(x.dtype)
        if NORM == 2:  # the rows the norm op writes: x * rstd * g rounded to x's dtype
            g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
            x = (_norm_input(x, r_ptr, m, k, s_rm, M, K, HAS_RES).to(tl.float32) * rstd[:, None] * g).to(x.dtype)
        elif NORM:  # the norm's scale factors out of the product: sum (x * g) * w over K, times rstd after
            x = _norm_input(x, r_ptr, m, k, s_rm, M, K, HAS_RES).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
            x = x * tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        return _product(acc, x, w, DOT, DOT_F32), ss


    @triton.jit
    def _second_step(acc, w, k, x2_rows, m_ok, K2, limit, alpha, ACT: tl.constexpr, CLAMP: tl.constexpr,
                     DOT: tl.constexpr, DOT_F32: tl.constexpr):
        """One K step of the second product (``TWO``): x2's columns ``k`` (through the activation) times ``w``."""
        x = tl.load(x2_rows + k[None, :], mask=m_ok[:, None] & (k < K2)[None, :], other=0.0)
        if ACT != 0:
            x = _act_input(x, x2_rows, k, m_ok, K2, limit, alpha, ACT, CLAMP)
        return _product(acc, x, w, DOT, DOT_F32)

    @triton.jit
    def _product(acc, x, w, DOT: tl.constexpr, DOT_F32: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] plus one K step's x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed."""
        if DOT and DOT_F32:  # the interpreter's bf16 dot is wrong: the same half-precision operands, in fp32
            x = x.to(w.dtype).to(tl.float32)
            return tl.dot(x, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        if DOT:
            return tl.dot(x.to(w.dtype), tl.trans(w), acc)
        return acc + tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


    @triton.jit
    def _act_input(x, x_rows, k, m_ok, K, limit, alpha, ACT: tl.constexpr, CLAMP: tl.constexpr):
        """act(x) for one K step, rounded to x's dtype: x is the gate part (read already); the up part sits K
        columns on (SiLU-and-mul, gpt-oss SwiGLU), or there is none (squared ReLU)."""
        a = x.to(tl.float32)
        up = a
        if ACT != 2:  # squared ReLU (RELU2 + 1) has no up part
            up = tl.load(x_rows + K + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0).to(tl.float32)
        return activate(a, up, limit, alpha, ACT - 1, CLAMP).to(x.dtype)


    @triton.jit
    def _gated_norm_input(x, q_ptr, g_ptr, m, k, s_qm, M, K, eps, HEAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr):
        """One K step of ``rms_norm_gated``: each head of HEAD columns scaled by its rstd, the weight and
        sigmoid(gate); the step holds whole heads (BLOCK_K a multiple of HEAD, steps starting at multiples)."""
        h = tl.reshape(x.to(tl.float32), (BLOCK_M, BLOCK_K // HEAD, HEAD))
        rstd = tl.rsqrt(tl.sum(h * h, axis=2) / HEAD + eps)
        h = tl.reshape(h * rstd[:, :, None], (BLOCK_M, BLOCK_K))
        w = tl.load(g_ptr + k % HEAD).to(tl.float32)
        q = tl.load(q_ptr + m[:, None] * s_qm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :],
                    other=0.0).to(tl.float32)
        return (h * w[None, :] * tl.sigmoid(q)).to(x.dtype)


    @triton.jit
    def _norm_input(x, r_ptr, m, k, s_rm, M, K, HAS_RES: tl.constexpr):
        """The norm's input rows: x, or x + residual rounded to x's dtype (as the rms_norm op rounds it)."""
        if HAS_RES:
            r = tl.load(r_ptr + m[:, None] * s_rm + k[None, :], mask=(m < M)[:, None] & (k < K)[None, :], other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        return x


Block = tuple[int, ...]  # (BLOCK_N, BLOCK_K, warps): CUDA cores; (BLOCK_N, BLOCK_K, warps, stages): tensor cores
MMA_DTYPES = (torch.bfloat16, torch.float16)


def tensor_cores(x_dtype: torch.dtype, w_dtype: torch.dtype) -> bool:
    """Whether the tensor-core blocks may run a product of these dtypes (both bf16 or both fp16: the rows are
    not rounded beyond what the reference reads)."""
    return x_dtype == w_dtype and w_dtype in MMA_DTYPES


def candidates(rows: int, n: int, k: int, mma: bool = False) -> list[Block]:
    """Block shapes worth timing for ``rows`` x [n, k]: up to :data:`MAX_ROWS` rows, 4, 8 or 16 weight rows a
    program, K steps as long as keep the fp32 products at 64 (4 warps) or 128 (8 warps) registers a thread; with
    ``mma`` (bf16 or fp16 operands, see :func:`tensor_cores`) and two rows or more, also tensor-core blocks of 16
    to 64 weight rows and 3 or 4 K steps in flight, which alone take 9 to :data:`MAX_MMA_ROWS` rows: the CUDA-core
    product's registers grow with the rows, which shortens its K steps and so the bytes each program has in
    flight, where the tensor cores' do not."""
    bm, out = next_pow2(rows), []
    cuda_cores = rows <= MAX_ROWS or not mma  # past MAX_ROWS only a direct call's default block (tests) uses them
    for bn, elems, warps in ((8, 8192, 4), (4, 8192, 4), (16, 16384, 8)) if cuda_cores else ():
        bn = min(bn, next_pow2(n))
        bk = max(16, min(elems // (bm * bn), next_pow2(k), 2048))
        if (bn, bk, warps) not in out:
            out.append((bn, bk, warps))
    if mma and rows >= 2:
        for bn, bk, stages in ((16, 256, 4), (32, 128, 4), (64, 128, 3)):
            block = (min(bn, max(16, next_pow2(n))), min(bk, max(16, next_pow2(k))), 4, stages)
            if block not in out:
                out.append(block)
    return out


def launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, K: int, block: Block, *,
           bias: torch.Tensor | None = None, add: torch.Tensor | None = None, activation: str | None = None,
           limit: float | None = None, alpha: float = 1.702, eps: float = 0.0,
           norm: tuple | None = None, gate: tuple | None = None, second: tuple | None = None,
           sigmoid_gate: torch.Tensor | None = None, early: bool | None = None, rounded: bool = False) -> None:
    """One launch of the skinny kernel writing ``y`` [M, N] from x's rows against weight [N, K] at ``block``.
    ``norm`` = (norm weight, residual or None, normed out, sum out): the RMSNorm prologue (``rounded``: the
    product reads the normalised rows rounded as the norm op writes them, after a first pass for their scale;
    else the scale factors out of it); ``gate`` = (norm
    weight [HEAD], gate rows [M, K]): the gated head norm; ``second`` = (x2, w2 [N, K2]): a second product, the
    ``activation`` then applying to x2; ``sigmoid_gate`` [M, H, G] (G: K / H, or 1 for one gate per head, any
    strides): x [M, H, K / H] (any row and head strides, unit channel stride) times its sigmoid. ``early``: whether
    the weight's first K step is read before the wait for the kernel before (default: when it is a model weight,
    :func:`~dayzero.ops.static.preload`)."""
    M, N = y.shape
    options = preload(x, weight)
    if early is not None:
        options["PRELOAD"] = early
    bn, bk, warps = block[:3]
    stages = block[3] if len(block) > 3 else None
    nw, res, normed, res_out = norm or (x, None, x, x)
    gw, grows = gate or (nw, x)
    x2, w2 = second or (x, weight)
    if second is not None and early is None and not is_static(w2):
        options["PRELOAD"] = False  # the second weight is read before the wait too: it must be a model weight
    if stages is not None and not (weight.dtype in MMA_DTYPES and w2.dtype in MMA_DTYPES):
        raise ValueError(f"tensor-core block {block} takes bf16 or fp16 weights, got {weight.dtype}, {w2.dtype}")
    sg = sigmoid_gate
    if sg is not None:
        grows = sg
    GV = K // sg.shape[1] if sg is not None else 1
    _skinny_kernel[(triton.cdiv(N, bn),)](
        x, weight, weight if bias is None else bias, y if add is None else add, y, M, N, K, x.stride(0),
        weight.stride(0), 0 if add is None else add.stride(0), y.stride(0),
        x if res is None else res, gw, normed, res_out, 0 if res is None else res.stride(0), float(eps),
        float(limit if limit is not None else 0.0), float(alpha), grows, grows.stride(0),
        x2, w2, w2.shape[1] if second else 0, x2.stride(0), w2.stride(0),
        sg.stride(1) if sg is not None else 0, sg.stride(2) if sg is not None and sg.shape[2] > 1 else 0, GV,
        x.stride(1) if sg is not None else 0,
        HAS_BIAS=bias is not None, HAS_ADD=add is not None, NORM=0 if norm is None else 2 if rounded else 1, HAS_RES=res is not None,
        ACT=ACTS[activation][0] if activation else 0, CLAMP=limit is not None,
        HEAD=gw.shape[0] if gate else 0, TWO=second is not None, SGATE=sg is not None, DOT=stages is not None,
        DOT_F32=DOT_F32, EVEN_K=K % bk == 0, BLOCK_M=max(16, next_pow2(M)) if stages else next_pow2(M),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, **({"num_stages": stages} if stages else {}), **options)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, block: Block | None = None,
                  add: torch.Tensor | None = None, activation: str | None = None,
                  limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """``act(x) · weightᵀ + bias + add`` by the Triton kernel (``block``: (BLOCK_N, BLOCK_K, warps), by default
    the first of :func:`candidates`); x [M <= MAX_MMA_ROWS, K] ([M, 2K] for a gated ``activation`` of :data:`ACTS`,
    ``limit`` its clamp), weight [N, K] and add [M, N] with unit column strides."""
    M, (N, K) = x.shape[0], weight.shape
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M:
        launch(x, weight, y, K, block or candidates(M, N, K)[0], bias=bias, add=add, activation=activation,
               limit=limit, alpha=alpha)
    return y


def chosen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype | None,
                  add: torch.Tensor | None, block: Block | None) -> torch.Tensor:
    """The linear as a measured choice runs it: the skinny kernel at ``block``, cuBLAS (the reference) for None."""
    if block is None:
        from dayzero.ops.linear.reference import linear

        return linear(x, weight, bias, out_dtype, add)
    return skinny_linear(x, weight, bias, out_dtype, block, add)


_CHOICE: dict[tuple, Block | None] = {}  # key -> the measured block shape, None: cuBLAS


def _key(x, weight, bias, out_dtype, add) -> tuple:
    return (next_pow2(x.shape[0]), weight.shape[0], x.shape[1], x.dtype, weight.dtype, out_dtype or x.dtype,
            None if bias is None else bias.dtype, None if add is None else add.dtype, x.device)


def measured_choice(x, weight, bias=None, out_dtype=None, add=None) -> Block | None:
    """The block shape that ran fastest at this call's key (measured at its first call), None for cuBLAS."""
    key = _key(x, weight, bias, out_dtype, add)

    def measure() -> Block | None:
        xs = torch.randn(key[0], x.shape[1], device=x.device).to(x.dtype)  # the bucket's rows, random
        adds = None if add is None else torch.randn(key[0], weight.shape[0], device=x.device).to(add.dtype)
        times = timings(xs, weight, bias, out_dtype, adds)
        best, choice = fastest_triton(times), fastest(times)
        log.info("linear %d x [%d, %d] %s: cuBLAS %.1f us, Triton %s %.1f us -> %s", key[0], key[1], key[2],
                 str(x.dtype).removeprefix("torch."), 1e3 * times[None], best, 1e3 * times[best], choice or "cuBLAS")
        return choice

    return measure_once(_CHOICE, key, x.device, measure, "linear")


def measure_once(choices: dict, key: tuple, device: torch.device, measure, op: str) -> Block | None:
    """``choices[key]``, at the key's first call that is eager on a CUDA device from the GPU model's choice tables
    (:mod:`dayzero.ops.choices`, under ``op``'s name) or else from ``measure()``, which the user's table then
    records; a call inside a capture, or on the CPU, gets None and records nothing (a later eager call measures).
    While ``measure`` runs, host waits are allowed (the engine's warm-up passes forbid them; these are the timing's
    own), and the weight copies' memory goes back to the device after, not left in the allocator's cache."""
    if key in choices:
        return choices[key]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return None
    store = choice_tables(device)
    found, value = store.get(op, key)
    if found:
        choices[key] = value
        return value
    debug = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        with torch.cuda.device(device):
            choices[key] = measure()
            torch.cuda.empty_cache()
    finally:
        torch.cuda.set_sync_debug_mode(debug)
    store.add(op, key, choices[key])
    return choices[key]


def timings(x, weight, bias=None, out_dtype=None, add=None) -> dict[Block | None, float]:
    """Device milliseconds per call at ``x``'s rows: cuBLAS (key None) and each of :func:`candidates`, each
    replayed from a CUDA graph over L2-cold copies of ``weight`` (:func:`fused_timings`, cuBLAS as the ops apart:
    a block that fails to run is left out)."""
    from dayzero.ops.linear.reference import linear

    return fused_timings(weight, lambda w: linear(x, w, bias, out_dtype, add),
                         lambda w, b: skinny_linear(x, w, bias, out_dtype, b, add),
                         candidates(x.shape[0], weight.shape[0], x.shape[1], tensor_cores(x.dtype, weight.dtype)))


def bucket_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """A tensor of x's dtype and device shaped like x with ``rows`` rows, holding no memory (an expanded element):
    what the timings, which draw their own random rows, need to know of a call."""
    return x.new_empty((1,) * x.dim()).expand(rows, *x.shape[1:])


def fused_timings(weight: torch.Tensor | tuple, apart, fused, blocks: list[Block]) -> dict[Block | None, float]:
    """Device milliseconds per call of ``apart(w)`` (key None: an op's own kernel, then the linear) and of
    ``fused(w, block)`` (the op inside the skinny kernel) at each of ``blocks``, each replayed from a CUDA graph
    over L2-cold copies of ``weight`` (a tuple of weights: copies of each, passed together)."""
    ws = cold_copies(weight) if isinstance(weight, torch.Tensor) else list(zip(*map(cold_copies, weight)))
    times = {None: graph_time([lambda w=w: apart(w) for w in ws])}
    for b in blocks:
        try:
            times[b] = graph_time([lambda w=w, b=b: fused(w, b) for w in ws])
        except Exception as e:  # noqa: BLE001 - a block shape this Triton cannot build: the others, or apart, run
            log.warning("skinny kernel block %s failed to run, left out of the choice: %s: %s", b,
                        type(e).__name__, e)
    return times


def fused_choice(what: str, times: dict[Block | None, float]) -> Block | None:
    """The fused launch's fastest block shape when it beat the ops apart in :func:`fused_timings`, else None;
    logged with ``what``."""
    if len(times) == 1:
        log.info("%s: apart %.1f us, no fused launch ran -> apart", what, 1e3 * times[None])
        return None
    best = fastest_triton(times)
    choice = best if times[best] < times[None] else None
    log.info("%s: apart %.1f us, fused %s %.1f us -> %s", what, 1e3 * times[None], best, 1e3 * times[best],
             choice or "apart")
    return choice


def fastest_triton(times: dict[Block | None, float]) -> Block | None:
    return min((b for b in times if b is not None), key=times.get, default=None)


def fastest(times: dict[Block | None, float]) -> Block | None:
    """The block shape to run from :func:`timings`: the fastest Triton one when it takes at most :data:`MARGIN` of
    cuBLAS's time, else None (cuBLAS, also when no Triton shape ran)."""
    best = fastest_triton(times)
    return best if best is not None and times[best] <= MARGIN * times[None] else None


def cold_copies(weight: torch.Tensor, total: int = 96 << 20, most: int = 16) -> list[torch.Tensor]:
    """``weight`` and copies of it, together past the L2 cache (a decode step reads each weight from memory once):
    as many as fit ``total`` bytes (at most ``most``), fewer where memory is short."""
    ws = [weight]
    try:
        while len(ws) < min(most, -(-total // max(1, weight.nbytes))):
            ws.append(mark_static(weight.clone()) if is_static(weight) else weight.clone())
    except torch.cuda.OutOfMemoryError:
        pass
    return ws


def graph_time(calls: list, replays: int = 5) -> float:
    """Device milliseconds per call of ``calls`` run in turn, captured once in a CUDA graph and replayed (each
    call run once before, eagerly, so that its kernels compile outside the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for c in calls:
                c()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(replays):
            graph.replay()
        end.record(stream)
        end.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    return start.elapsed_time(end) / (replays * len(calls))


def refusal(x, weight, bias=None, out_dtype=None, add=None) -> str | None:
    """Why the skinny kernel cannot take this call (shapes, layouts, autograd), or None."""
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return "the kernel takes x [rows, K] and a weight [N, K]"
    most = MAX_MMA_ROWS if tensor_cores(x.dtype, weight.dtype) else MAX_ROWS
    if not 0 < x.shape[0] <= most:
        return (f"{x.shape[0]} rows: the kernel takes 1 to {MAX_ROWS} ({MAX_MMA_ROWS} with bf16 or fp16 operands on "
                "the tensor cores), cuBLAS's GEMM tiles the rest")
    if add is not None and add.shape != (x.shape[0], weight.shape[0]):
        return f"add must be [rows, N], got {tuple(add.shape)}"
    if any(t is not None and t.stride(-1) != 1 for t in (x, weight, bias, add)):
        return "operands need contiguous rows"
    if (any(t is not None and t.dtype not in DTYPES for t in (x, weight, bias, add))
            or (out_dtype or x.dtype) not in DTYPES):
        return "dtypes other than bf16, fp16 and fp32"
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias, add)):
        return "no backward: autograd calls take cuBLAS"
    return None


def _verify(x, weight, bias=None, out_dtype=None, add=None) -> str | None:
    why = refusal(x, weight, bias, out_dtype, add)
    if why is None and measured_choice(x, weight, bias, out_dtype, add) is None:
        return "cuBLAS is as fast or faster at this shape (measured), or its first call was inside a capture"
    return why


@register("linear", "cuda", verifier=_verify,
          note="Triton for 1-8 rows (up to 64 on the tensor cores) where measured faster than cuBLAS")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    return skinny_linear(x, weight, bias, out_dtype, _CHOICE[_key(x, weight, bias, out_dtype, add)], add)

