"""The routed experts of a step with few (token, expert) pairs, without sorting them: two Triton launches.

A decode step routes a handful of tokens: at batch 1 with top-8 there are 8 pairs over 64+ experts, so the
sorted path's four or five launches (the sort, the two grouped GEMMs with row tiles of at least 16 rows for
one real row, the inverse of the sort and the weighted gather) are mostly fixed cost. Here

- ``_direct_up_kernel``, one program per (pair, column block of I): ``h[p] = act(x[t] · w1[e]^T + b1[e])``
  for pair p = t·k + j of expert e = ids[t, j], read straight from the ids; the programs of the first column
  block also raise the layer's load counters (``load[e'] += 1`` for every e' >= e: the running sums of the
  sorted path's row ends, so the counters read the same whichever path ran);
- ``_direct_down_kernel``, one program per (token, column block of L): ``y[t] = Σ_j w[t, j] · (h[t·k+j] ·
  w2[e_j]^T + b2[e_j])`` with the k slots' weight rows read together (one tile of k × BLOCK_N rows, not one
  expert after another), the k expert outputs rounded to the activations' dtype before the fp32 weighted sum,
  as the sorted path rounds its rows, and summed in slot order (the same result from run to run).

Each program is a GEMV over its weight rows (fp32 products summed along K, no tensor-core tile to fill with
one row); weights are read in their stored format through the grouped kernels' ``weight_rows``. With FP8
activations (``TileScaled.fp8_activations``) each 128-wide K step of a row goes through e4m3 and back first:
the values the grouped kernels' FP8 dot multiplies. Nothing is
read on the host and the grid comes from shapes alone, so a CUDA graph captures it. An expert hit by several
pairs is read once per pair, so the path pays off while pairs are at most about the expert count
(:func:`direct_max_pairs`); longer steps keep the sort.
"""
from __future__ import annotations

import functools

import torch

from dayzero.ops.moe import route_kernels, triton_moe
from dayzero.ops.static import preload
from dayzero.ops.triton_support import DOT_F32, HAS_TRITON, next_pow2, pdl, tl, triton
from dayzero.quant.fp8 import TILE, takes_fp8_activations

if HAS_TRITON:
    from dayzero.ops.moe import triton_moe_kernels as K
    from dayzero.ops.moe.route_kernels import expert_ranks
    from dayzero.ops.triton_support import grid_dependency

# Formats whose K step may span the whole 4096-element budget; the quantised ones read at most one 128-column tile
# a K step (the tile-scaled FP8 kernel applies one scale per step; MXFP4 steps of eight 32-blocks gave wrong rows on
# the H200 at one shape while four blocks, as the grouped kernels read them, passed at every checked shape).
PLAIN = ("bfloat16", "float16", "float32")
MAX_TOP_K = 32  # the second kernel holds a row block per slot
TILE_ELEMS = 4096  # weight elements a program holds per K step (fp32 products: 32 registers a thread at 4 warps)
# early routing (moe_experts_routed(early=True)) ranks the second kernel's slots early too from this many tokens: in
# a chain of dayzero-small's 23 MoE layers on the H100 (benchmarks/moe_decode.py --early) it took a layer 14.13 ->
# 17.21 us at one token (every program ranks 64 experts for 8 weight rows) and 29.98 -> 28.28 us at four
DOWN_EARLY_ROWS = 4
DOWN_WARPS = 8  # the second kernel's warps
# the early-routed first kernel's column blocks are at least this wide: fewer programs, more of them resident (and
# routed, their first weight step read) while the kernel before runs. In that chain at one token (8 pairs, where
# the rule of about two programs an SM gives 8 columns) 16 columns took 13.35 us a layer against 14.02 at 8 (and
# 15.29 against 17.21 with the second kernel early too); at four tokens the rule gives 32 already
EARLY_MIN_COLS = 16

if HAS_TRITON:
    @triton.jit
    def _gemv(acc, v, w_ptr, s_ptr, e, n, n_ok, k0, KW, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
              FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """acc [BLOCK_N] += W[e, n, k0:k0+BLOCK_K] · v [BLOCK_K], in fp32."""
        w = K.weight_tile(w_ptr, s_ptr, e, n, n_ok, k0, KW, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                           FMT, BLOCK_N, BLOCK_K, tl.float32)
        part = tl.sum(w * v[None, :], 1)
        if FMT == K.TILE:  # one scale per 128x128 tile, constant over this K step (BLOCK_K divides 128)
            part *= tl.load(s_ptr + e * s_se + (n // 128) * s_sn + (k0 // 128) * s_sk, mask=n_ok, other=0.0)
        return acc + part

    @triton.jit
    def _x_step(x_ptr, t, s_xm, k0, L, ACT_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
        """Columns k0..k0+BLOCK_K of token t's row, fp32 (through e4m3 with FP8 activations)."""
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(x_ptr + t * s_xm + k, mask=k < L, other=0.0).to(tl.float32)
        return tl.reshape(K.fake_quantize_rows(tl.reshape(v, (1, BLOCK_K)), ACT_FP8, ROUND_FIRST), (BLOCK_K,))

    @triton.jit
    def _h_step(h_ptr, p, ok, k0, I, ACT_FP8: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_K: tl.constexpr):
        """Columns k0..k0+BLOCK_K of the pairs' ``p`` [R] hidden rows (rows not ``ok`` zero), fp32 (through e4m3
        with FP8 activations)."""
        k = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(h_ptr + p[:, None] * I + k[None, :], mask=ok[:, None] & (k[None, :] < I), other=0.0)
        return K.fake_quantize_rows(v.to(tl.float32), ACT_FP8, ROUND_FIRST)

    @triton.jit
    def route_pair(logits_ptr, corr_ptr, t, p, scale, E, TOP_K: tl.constexpr, GS: tl.constexpr,
                   SQRT_SOFTPLUS: tl.constexpr, HAS_CORR: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr,
                   TOPG: tl.constexpr, E_POW2: tl.constexpr, BG: tl.constexpr):
        """Pair p's expert (of rank p mod k among token t's, int64) and its routing weight (fp32)."""
        ee, s, rank = expert_ranks(logits_ptr, corr_ptr, t, E, GS, SQRT_SOFTPLUS, HAS_CORR, G, TOPG, TOP_K,
                                   E_POW2, BG)
        mine = rank == (p % TOP_K).to(tl.int32)
        # NaN logits may give rank j to no expert or to several: the id stays in range
        e = tl.minimum(tl.sum(tl.where(mine, ee, 0), axis=0).to(tl.int64), E - 1)
        w = tl.sum(tl.where(mine, s, 0.0), axis=0)
        if NORM:
            w = w / (tl.sum(tl.where(rank < TOP_K, s, 0.0), axis=0) + 1e-20)
        return e, w * scale

    @triton.jit
    def route_slots(logits_ptr, corr_ptr, t, j, E, TOP_K: tl.constexpr, GS: tl.constexpr,
                    SQRT_SOFTPLUS: tl.constexpr, HAS_CORR: tl.constexpr, G: tl.constexpr, TOPG: tl.constexpr,
                    E_POW2: tl.constexpr, BG: tl.constexpr):
        """The experts of ranks ``j`` [R] among token t's (int64), each as :func:`route_pair` takes it."""
        ee, s, rank = expert_ranks(logits_ptr, corr_ptr, t, E, GS, SQRT_SOFTPLUS, HAS_CORR, G, TOPG, TOP_K,
                                   E_POW2, BG)
        mine = rank[None, :] == j[:, None].to(tl.int32)  # [R, E_POW2]
        return tl.minimum(tl.sum(tl.where(mine, ee[None, :], 0), axis=1).to(tl.int64), E - 1)

    @triton.jit
    def expert_weight_tile(w_ptr, s_ptr, e, n, n_ok, KW, s_we, s_wn, s_wk, s_se, s_sn, s_sk, FMT: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Expert e's weight rows ``n``, first K step, as the GEMV reads them (a plain format: no scales); ``e``
        may be one expert or one per row (the second kernel's slots)."""
        return K.weight_tile(w_ptr, s_ptr, e, n, n_ok, 0, KW, s_we, s_wn, s_wk, s_se, s_sn, s_sk, FMT, BLOCK_N,
                             BLOCK_K, tl.float32)

    @triton.jit(do_not_specialize=["limit", "scale"])
    def _direct_up_kernel(x_ptr, ids_ptr, w_ptr, ws_ptr, b_ptr, h_ptr, load_ptr, limit, E,
                          L: tl.constexpr, I: tl.constexpr, s_xm, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn,
                          logits_ptr, corr_ptr, wt_ptr, scale,
                          FMT: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_LIMIT: tl.constexpr, HAS_LOAD: tl.constexpr, TOP_K: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, E_POW2: tl.constexpr, PDL: tl.constexpr,
                          ACT_FP8: tl.constexpr = False, ROUND_FIRST: tl.constexpr = False,
                          ROUTE: tl.constexpr = False, GS: tl.constexpr = 1, SQRT_SOFTPLUS: tl.constexpr = False,
                          HAS_CORR: tl.constexpr = False, NORM: tl.constexpr = False, G: tl.constexpr = 1,
                          TOPG: tl.constexpr = 1, BG: tl.constexpr = 1, EARLY: tl.constexpr = False,
                          PRELOAD: tl.constexpr = False):
        # x: [T, L] (unit column stride); ids: [T*k]; w1: [E, r*I, L]; h: [T*k, I]; grid: T*k x cdiv(I, BLOCK_N)
        # ROUTE: logits [T, E] fp32; ids and wt [T*k] written here, by the programs of the first column block.
        # EARLY (with ROUTE): the logits were written two kernels or more before this one, so they are final once
        # this kernel runs at all (the kernel before lets it start only after its own wait, for the kernels
        # before it): the pair is routed before the wait, and with PRELOAD (a model weight in a plain format)
        # the expert's first K step is read too, while the kernel before still runs.
        pid_p = tl.program_id(0)
        pid_n = tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < I
        if EARLY:
            e, w = route_pair(logits_ptr, corr_ptr, pid_p // TOP_K, pid_p, scale, E, TOP_K, GS, SQRT_SOFTPLUS,
                              HAS_CORR, NORM, G, TOPG, E_POW2, BG)
        if PRELOAD:
            wa_first = expert_weight_tile(w_ptr, ws_ptr, e, cols, col_ok, L, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                                          FMT, BLOCK_N, BLOCK_K)
            if GATED:
                wb_first = expert_weight_tile(w_ptr, ws_ptr, e, cols + I, col_ok, L, s_we, s_wn, s_wk, s_se, s_sn,
                                              s_sk, FMT, BLOCK_N, BLOCK_K)
        grid_dependency(PDL)
        p = pid_p.to(tl.int64)
        t = p // TOP_K
        if not EARLY:
            if ROUTE:  # this pair's token routed here: pair p is its expert of rank p mod k
                e, w = route_pair(logits_ptr, corr_ptr, t, p, scale, E, TOP_K, GS, SQRT_SOFTPLUS, HAS_CORR, NORM,
                                  G, TOPG, E_POW2, BG)
            else:  # an id out of range (the routing of NaN logits) reads no other memory
                e = tl.minimum(tl.maximum(tl.load(ids_ptr + p).to(tl.int64), 0), E - 1)
        if ROUTE:
            if pid_n == 0:
                tl.store(ids_ptr + p, e)
                tl.store(wt_ptr + p, w)
        acc_a = tl.zeros((BLOCK_N,), dtype=tl.float32)  # gate (or relu2's only) half
        acc_b = tl.zeros((BLOCK_N,), dtype=tl.float32)  # up half
        if PRELOAD:  # a plain format: the tiles' product, no scale
            v = _x_step(x_ptr, t, s_xm, 0, L, ACT_FP8, ROUND_FIRST, BLOCK_K)
            acc_a += tl.sum(wa_first * v[None, :], 1)
            if GATED:
                acc_b += tl.sum(wb_first * v[None, :], 1)
        for k0 in range(BLOCK_K if PRELOAD else 0, L, BLOCK_K):
            v = _x_step(x_ptr, t, s_xm, k0, L, ACT_FP8, ROUND_FIRST, BLOCK_K)
            acc_a = _gemv(acc_a, v, w_ptr, ws_ptr, e, cols, col_ok, k0, L, s_we, s_wn, s_wk, s_se, s_sn, s_sk,
                          FMT, BLOCK_N, BLOCK_K)
            if GATED:
                acc_b = _gemv(acc_b, v, w_ptr, ws_ptr, e, cols + I, col_ok, k0, L, s_we, s_wn, s_wk, s_se, s_sn,
                              s_sk, FMT, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            acc_a += tl.load(b_ptr + e * s_be + cols * s_bn, mask=col_ok, other=0.0).to(tl.float32)
            if GATED:
                acc_b += tl.load(b_ptr + e * s_be + (cols + I) * s_bn, mask=col_ok, other=0.0).to(tl.float32)
        h = K.activate(acc_a, acc_b, limit, ACT, HAS_LIMIT)
        tl.store(h_ptr + p * I + cols, h.to(h_ptr.dtype.element_ty), mask=col_ok)
        if HAS_LOAD:
            if pid_n == 0:  # one program per pair: every row end at or past its expert moves by one
                idx = tl.arange(0, E_POW2)
                tl.atomic_add(load_ptr + idx, tl.full((E_POW2,), 1, tl.int64), mask=(idx >= e) & (idx < E))

    @triton.jit
    def _direct_down_kernel(h_ptr, ids_ptr, wt_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, E,
                            L: tl.constexpr, I: tl.constexpr, s_we, s_wn, s_wk, s_se, s_sn, s_sk, s_be, s_bn, s_ym,
                            logits_ptr, corr_ptr,
                            FMT: tl.constexpr, HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, K_POW2: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
                            ACT_FP8: tl.constexpr = False, ROUND_FIRST: tl.constexpr = False,
                            GS: tl.constexpr = 1, SQRT_SOFTPLUS: tl.constexpr = False, HAS_CORR: tl.constexpr = False,
                            G: tl.constexpr = 1, TOPG: tl.constexpr = 1, E_POW2: tl.constexpr = 1,
                            BG: tl.constexpr = 1, EARLY: tl.constexpr = False, PRELOAD: tl.constexpr = False):
        # h: [T*k, I]; ids, wt: [T*k]; w2: [E, L, I]; y: [T, L]; grid: T x cdiv(L, BLOCK_N)
        # The program's rows are (slot j, column n) for all k slots at once, so the k experts' weights are read
        # in one go rather than one expert after another: K_POW2 * BLOCK_N rows, r = j * BLOCK_N + c.
        # EARLY: the logits [T, E] fp32 were written three kernels or more before this one (the first kernel
        # routed early): the slots' experts are ranked here before the wait, as the first kernel ranked them, and
        # with PRELOAD (a model weight in a plain format) their first K step is read too.
        r = tl.arange(0, K_POW2 * BLOCK_N)
        n = tl.program_id(1) * BLOCK_N + r % BLOCK_N
        ok = (r // BLOCK_N < TOP_K) & (n < L)
        if EARLY:
            e = route_slots(logits_ptr, corr_ptr, tl.program_id(0), r // BLOCK_N, E, TOP_K, GS, SQRT_SOFTPLUS,
                            HAS_CORR, G, TOPG, E_POW2, BG)
        if PRELOAD:
            w_first = expert_weight_tile(w_ptr, ws_ptr, e, n, ok, I, s_we, s_wn, s_wk, s_se, s_sn, s_sk, FMT,
                                         K_POW2 * BLOCK_N, BLOCK_K)
        grid_dependency(PDL)
        R: tl.constexpr = K_POW2 * BLOCK_N
        t = tl.program_id(0).to(tl.int64)
        j = r // BLOCK_N
        p = t * TOP_K + j  # each row's pair
        if not EARLY:
            e = tl.minimum(tl.maximum(tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int64), 0), E - 1)
        w_row, s_row = e * s_we + n * s_wn, e * s_se + n * s_sn
        if FMT == K.TILE:  # one scale row per 128 weight rows
            s_row = e * s_se + (n // 128) * s_sn
        acc = tl.zeros((R,), dtype=tl.float32)
        if PRELOAD:  # a plain format: the tile's product, no scale
            acc += tl.sum(w_first * _h_step(h_ptr, p, ok, 0, I, ACT_FP8, ROUND_FIRST, BLOCK_K), 1)
        for k0 in range(BLOCK_K if PRELOAD else 0, I, BLOCK_K):
            w = K.weight_rows(w_ptr, ws_ptr, w_row, s_row, ok, k0, I, s_wk, s_sk, FMT, R, BLOCK_K, tl.float32)
            part = tl.sum(w * _h_step(h_ptr, p, ok, k0, I, ACT_FP8, ROUND_FIRST, BLOCK_K), 1)
            if FMT == K.TILE:  # one scale per 128x128 tile, constant over this K step (BLOCK_K divides 128)
                part *= tl.load(ws_ptr + s_row + (k0 // 128) * s_sk, mask=ok, other=0.0)
            acc += part
        if HAS_BIAS:
            acc += tl.load(b_ptr + e * s_be + n * s_bn, mask=ok, other=0.0).to(tl.float32)
        row = acc.to(y_ptr.dtype.element_ty).to(tl.float32)  # each expert's output, rounded as stored rows are
        wgt = tl.load(wt_ptr + p, mask=ok, other=0.0).to(tl.float32)
        out = tl.sum(tl.reshape(wgt * row, (K_POW2, BLOCK_N)), 0)  # over the slots, in slot order
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + t * s_ym + cols, out.to(y_ptr.dtype.element_ty), mask=cols < L)


def direct_max_pairs(num_experts: int) -> int:
    """The most (token, expert) pairs the direct path takes: half the experts (at least 8). Pairs that hit one
    expert read its weights once each here, where the sort reads them once for all; with k of E experts drawn
    per token, T tokens hit E·(1 - (1 - k/E)^T) distinct experts, so at half the experts in pairs the direct
    path reads ~1.2x the sort's weight bytes, against the sort's three or four extra launches."""
    return max(num_experts // 2, 8)


@functools.lru_cache(maxsize=8)
def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the device about twice (two per SM on a GPU)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def _k_step(rows: int, depth: int, fmt: str, elems: int = TILE_ELEMS, act_fp8: bool = False) -> int:
    """K step for ``rows`` weight rows a program holds: as long as fits ``elems`` (32 to 512; at most one 128-tile
    for quantised weights, see :data:`PLAIN`; exactly one 128-wide group of FP8 activations)."""
    if act_fp8:
        return TILE
    bk = max(32, min(elems // rows, next_pow2(depth), 512))
    return bk if fmt in PLAIN else min(bk, TILE)


def blocks(rows: int, width: int, depth: int, want: int, fmt: str, act_fp8: bool = False,
           least: int = 4) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the first kernel, ``rows`` GEMVs of ``width`` outputs over ``depth`` inputs: column
    blocks as wide as leaves about ``want`` programs (``least`` to 64 columns), then the K step (:func:`_k_step`)."""
    bn = 64
    while bn > least and rows * -(-width // bn) < want:
        bn //= 2
    bn = min(bn, next_pow2(width))
    return bn, _k_step(bn, depth, fmt, act_fp8=act_fp8)


def down_blocks(tokens: int, top_k: int, width: int, depth: int, want: int, fmt: str,
                act_fp8: bool = False) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of the second kernel, whose programs hold the rows of all k slots (k_pow2 · BLOCK_N of
    them, at most 256, or 64 with the 128-wide K steps of FP8 activations): column blocks as wide as leaves about
    ``want`` programs, down to one column."""
    kp = next_pow2(top_k)
    bn = max(1, min(64, (64 if act_fp8 else 256) // kp, next_pow2(width)))
    while bn > 1 and tokens * -(-width // bn) < want:
        bn //= 2
    return bn, _k_step(kp * bn, depth, fmt, 2 * TILE_ELEMS, act_fp8)


def refusal(x, ids, weights, w1, w2, activation: str = "silu", b1=None, b2=None, limit=None,
            max_pairs: int | None = None) -> str | None:
    """Why the direct kernels should not run this step (more pairs than ``max_pairs``, by default
    :func:`direct_max_pairs`) or cannot, or None."""
    if ids.dim() != 2 or weights.shape != ids.shape or x.dim() != 2 or ids.shape[0] != x.shape[0]:
        return "the reference checks these shapes"
    if ids.device != x.device or ids.is_floating_point():
        return f"ids must be integer expert ids on {x.device}"
    return _pairs_refusal(x, ids.shape[1], w1, w2, activation, b1, b2, limit, max_pairs)


def _pairs_refusal(x, top_k: int, w1, w2, activation, b1, b2, limit, max_pairs: int | None) -> str | None:
    """:func:`refusal` for ``top_k`` experts per token of ``x``, whatever routes them."""
    most = direct_max_pairs(w1.shape[0]) if max_pairs is None else max_pairs
    if x.shape[0] * top_k > most:
        return f"{x.shape[0] * top_k} (token, expert) pairs: past {most} the sorted path reads less"
    if top_k > MAX_TOP_K:
        return f"{top_k} experts per token exceed the kernel's {MAX_TOP_K}"
    if x.stride(-1) != 1:
        return "the token rows must have contiguous columns"
    return triton_moe.refusal(x, None, w1, w2, activation, b1, b2, limit)


def routed_refusal(x, routing: tuple, w1, w2, activation: str = "silu", b1=None, b2=None, limit=None,
                   max_pairs: int | None = None) -> str | None:
    """Why the first kernel should not route the tokens ``x`` itself (:func:`moe_experts_routed`), or None.
    ``routing``: ``moe_route``'s arguments after the logits (top_k, kind, correction_bias, n_group, topk_group,
    norm_topk_prob, routed_scaling_factor)."""
    if x.dim() != 2:
        return "the reference checks these shapes"
    E = w1.shape[0]
    why = route_kernels.route_refusal(x.new_empty((0, E), dtype=torch.float32), *routing)  # the logits' shape
    return why or _pairs_refusal(x, routing[0], w1, w2, activation, b1, b2, limit, max_pairs)


def moe_experts_direct(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w2, activation: str = "silu",
                       b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, limit: float | None = None,
                       load: torch.Tensor | None = None, block: tuple[tuple[int, int], tuple[int, int]] | None = None,
                       ) -> torch.Tensor:
    """``y_t = Σ_j weights[t, j] · Expert_{ids[t, j]}(x_t)``, the reference ``moe_experts``'s contract (``load``
    raised as ``moe_permute`` raises it). Call only when :func:`refusal` is None; ``block`` overrides the
    ((BLOCK_N, BLOCK_K) of the first kernel, that of the second) (tests)."""
    # x: [T, L]; ids, weights: [T, k]; w1: [E, r*I, L]; w2: [E, L, I] -> [T, L]
    flat_ids, wt = ids.reshape(-1).contiguous(), weights.reshape(-1).float().contiguous()
    return _launch(x, ids.shape[1], flat_ids, wt, w1, w2, activation, b1, b2, limit, load, block)


def moe_experts_routed(x: torch.Tensor, logits: torch.Tensor, routing: tuple, w1, w2, activation: str = "silu",
                       b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, limit: float | None = None,
                       load: torch.Tensor | None = None, block: tuple[tuple[int, int], tuple[int, int]] | None = None,
                       up_warps: int = 4, early: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`moe_experts_direct` of ``moe_route(logits, *routing)``'s choice, routed inside the first kernel: each
    program ranks its token's experts (``route_kernels.expert_ranks``) and takes the expert of its pair's rank,
    and the first column block's programs write the ids and weights the second kernel reads, so the routing
    kernel's launch is gone. Returns (y [T, L], weights fp32 [T, k], ids int64 [T, k]). Call only when
    :func:`routed_refusal` is None; ``up_warps``: the first kernel's warps (``benchmarks/moe_decode.py``).

    ``early``: the logits were written at least two kernels before this op's first (the caller ran another kernel
    in between: MoE layers compute the router first, then the experts' input projection). The first kernel then
    routes before waiting for the kernel before it, and reads its expert's first weight step too (a model weight
    in bf16, fp16 or fp32), while that kernel runs; the second kernel ranks its slots' experts the same way
    before its own wait and reads their first weight step (from :data:`DOWN_EARLY_ROWS` tokens). Passing it for
    logits of the kernel just before is a race."""
    # x: [T, L]; logits: [T, E] fp32 contiguous; w1: [E, r*I, L]; w2: [E, L, I]
    top_k, kind, corr, n_group, topk_group, norm, scale = routing
    T, E = logits.shape
    if T != x.shape[0] or E != w1.shape[0] or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"logits must be fp32 [T={x.shape[0]}, E={w1.shape[0]}] rows, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    ids = torch.empty(T, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=x.device)
    c = route_kernels.route_constants(E, top_k, kind, corr, n_group, topk_group, norm)
    route = ((logits, logits if corr is None else corr, weights, float(scale)),  # the first kernel's routing operands
             dict(ROUTE=True, GS=c["GS"], SQRT_SOFTPLUS=c["SQRT_SOFTPLUS"], HAS_CORR=c["HAS_BIAS"], NORM=c["NORM"],
                  G=c["G"], TOPG=c["TOPG"], BG=c["BG"], EARLY=early))
    y = _launch(x, top_k, ids.view(-1), weights.view(-1), w1, w2, activation, b1, b2, limit, load, block, route,
                up_warps)
    return y, weights, ids


def _launch(x, k, flat_ids, wt, w1, w2, activation, b1, b2, limit, load, block, route=None,
            up_warps: int = 4) -> torch.Tensor:
    """The two kernels; ``route``: (logits, correction bias, weights out, scale) and the first kernel's routing
    constants, when it routes (:func:`moe_experts_routed`)."""
    (T, L), E, I = x.shape, w1.shape[0], w2.shape[-1]
    y = triton_moe.new_buffer(T, L, x)
    if T == 0:
        return y
    gated = activation != "relu2"
    fmt = triton_moe.format_key(w1, w2)
    want = _programs_wanted(x.device)
    a1, a2 = takes_fp8_activations(w1), takes_fp8_activations(w2)
    operands, routed = route or ((wt, wt, wt, 1.0), {})  # unread without ROUTE
    early = routed.get("EARLY", False)  # routed before the kernels' waits
    preloads = early and fmt in PLAIN  # and their first weight steps read there
    (bn1, bk1), (bn2, bk2) = block or (blocks(T * k, I, L, want, fmt, a1, EARLY_MIN_COLS if preloads else 4),
                                       down_blocks(T, k, L, I, want, fmt, a2))
    if fmt not in PLAIN and max(bk1, bk2) > TILE:
        raise ValueError(f"{fmt} weights take K steps of at most {TILE}, not {max(bk1, bk2)} (see PLAIN)")
    if (a1 and bk1 != TILE) or (a2 and bk2 != TILE):
        raise ValueError(f"FP8 activations take K steps of {TILE} (one quantisation group), not {bk1} / {bk2}")
    h = triton_moe.new_buffer(T * k, I, x)
    act = {"silu": K.SILU, "relu2": K.RELU2, "swiglu_oai": K.SWIGLU_OAI}[activation].value

    f, data, scale, st, ss = triton_moe.weight_operand(w1)
    options = preload(x, data)  # the expert's first K step before the wait: routed early, a plain model weight
    options["PRELOAD"] = options["PRELOAD"] and preloads
    _direct_up_kernel[(T * k, triton.cdiv(I, bn1))](
        x, flat_ids, data, scale, x if b1 is None else b1, h, flat_ids if load is None else load,
        0.0 if limit is None else float(limit), E, L, I, x.stride(0), *st, *ss,
        *((0, 0) if b1 is None else b1.stride()),
        *operands,
        FMT=f, ACT=act, GATED=gated, HAS_BIAS=b1 is not None, HAS_LIMIT=limit is not None, HAS_LOAD=load is not None,
        TOP_K=k, BLOCK_N=bn1, BLOCK_K=bk1, E_POW2=next_pow2(E), ACT_FP8=a1, ROUND_FIRST=DOT_F32, **routed,
        num_warps=up_warps, **options)

    f, data, scale, st, ss = triton_moe.weight_operand(w2)
    ranks = {}  # the slots ranked before the wait, as the first kernel ranked them, and their first weight step
    if early and T >= DOWN_EARLY_ROWS:
        ranks = {name: routed[name] for name in ("GS", "SQRT_SOFTPLUS", "HAS_CORR", "G", "TOPG", "BG", "EARLY")}
        ranks.update(E_POW2=next_pow2(E), **preload(h, data))
        ranks["PRELOAD"] = ranks["PRELOAD"] and preloads
    _direct_down_kernel[(T, triton.cdiv(L, bn2))](
        h, flat_ids, wt, data, scale, h if b2 is None else b2, y, E, L, I, *st, *ss,
        *((0, 0) if b2 is None else b2.stride()), y.stride(0), *operands[:2],
        FMT=f, HAS_BIAS=b2 is not None, TOP_K=k, K_POW2=next_pow2(k), BLOCK_N=bn2, BLOCK_K=bk2, ACT_FP8=a2,
        ROUND_FIRST=DOT_F32, num_warps=DOWN_WARPS, **{**pdl(h), **ranks})
    return y
