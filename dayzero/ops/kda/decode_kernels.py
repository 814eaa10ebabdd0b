"""``kda_decode`` in one Triton launch: one program per (sequence, head, block of value columns) of a decode step.

A program reads its head's q, k and v channels and the gate inputs from the sequence's projection row, runs the
short conv over its slot's windows (zero for a fresh sequence), multiplies the forget gate's low-rank input by its
head's rows of the up-projection (and the output gate's by its value columns' rows: the output gate is written
for the gated norm), activates the gate and beta, L2-normalises q and k and runs the delta rule on its
[K, V / NV] columns of the head's state: read once (as zero for a fresh sequence, so no launch zeroes the slot
first), decayed, updated and written back in place, :data:`CHUNK_COLS` columns at a time, the next chunk's
state and v windows loading while the current one is updated (on the H200 chunks of 64 took a whole head's
step at 32 and 64 sequences 0.88-0.89x the time of holding all 128 columns at once; chunks of 32 took
1.07-1.11x). Columns of the state are independent, so a head's NV programs split it without exchanging
anything; NV grows as the step's sequences x heads fall below the GPU's width (at batch 1 a head's 64 KB state
read by one program would take longer than the four kernels it replaces).

The windows: a program owns its value columns' v windows; q's and k's are read whole by all NV programs of the
head, so the last of them to arrive writes them (:func:`head_arrival`: a counter per (sequence, head), which each
program raises by COUNT_PERIOD / NV with acquire-release semantics right after reading the windows, before the
wait; the program that brings it to a multiple of :data:`COUNT_PERIOD` is the last, whatever NV the launches
before had, so nothing puts it back and no atomic or fence is left for a program's end). The counters are one
int32 per (sequence, head) per layer, made at the layer's first eager call (a layer first met inside a CUDA-graph
capture runs the composition). What a program reads that the kernel before does not write is read before the wait
for that kernel, while it still runs: the gates' up-projection rows, a model weight (:mod:`dayzero.ops.static`,
``PRELOAD``), and the sequence's slot, its first chunk of state columns and its conv windows
(:func:`carried_state`: the layer's pools, which only this kernel writes). After the wait a program reads the
projection row, so it is about one memory round trip, its products and its stores. Padding rows
of a captured step all use the null slot 0, which nothing reads. The composition's rounding is kept: the conv's
output and the forget gate's up-projection are rounded to the activations' dtype as the ops apart store them.

Above :data:`UP_MAX_ROWS` sequences the up-projections run as one batched GEMM first (each program would
otherwise read its head's K x K weights again for every sequence) and the kernel reads the forget gate's
product. Same math as :mod:`dayzero.ops.kda.step`'s composition.
"""
from __future__ import annotations

import torch

from dayzero.ops.attention.cuda import NOT_DECODE
from dayzero.ops.kda.step import gate_ups, split_projection
from dayzero.ops.registry import register
from dayzero.ops.static import preload
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, tl, triton, triton_refusal

UP_MAX_ROWS = 4  # up to this many sequences the programs run the gates' up-projections themselves
TARGET_PROGRAMS = 256  # split heads' value columns until a step has about this many programs
CHUNK_COLS = 64  # a program's value columns go through the delta rule this many at a time, the next one loading
MAX_TAPS = 8
MIN_COLS = 16  # a head's value columns split no finer than this
COUNT_PERIOD = 64  # a power of two at least any split: each launch raises a (sequence, head) counter by this much

if HAS_TRITON:
    from dayzero.ops.static import weight_tile
    from dayzero.ops.triton_support import grid_dependency, softplus

    @triton.jit
    def _window(win, s_chan, ch, W: tl.constexpr, BW: tl.constexpr):
        """The conv windows of channels ``ch`` [K]: their old inputs [K, BW] (columns past W - 2 zero) and the same
        shifted by one (what stays in the new window), fp32."""
        col = tl.arange(0, BW)
        u = tl.load(win + ch[:, None] * s_chan + col[None, :], mask=(col < W - 1)[None, :], other=0.0)
        later = tl.load(win + ch[:, None] * s_chan + col[None, :] + 1, mask=(col < W - 2)[None, :], other=0.0)
        return u.to(tl.float32), later.to(tl.float32)

    @triton.jit
    def _conv(x, u, later, cw_ptr, ch, fresh, W: tl.constexpr, BW: tl.constexpr):
        """SiLU of the causal conv of one token's inputs ``x`` [K] over channels ``ch`` given their windows
        (:func:`_window`; zero for a fresh sequence), fp32 and unrounded, and the channels' new windows [K, BW]
        (the old one's columns 1 .. W-2, then the token's input), not yet stored."""
        col = tl.arange(0, BW)
        u = tl.where(fresh, 0.0, u)
        taps = tl.load(cw_ptr + ch[:, None] * W + col[None, :], mask=(col < W - 1)[None, :], other=0.0).to(tl.float32)
        y = tl.sum(u * taps, 1) + x * tl.load(cw_ptr + ch * W + (W - 1)).to(tl.float32)
        new = tl.where((col == W - 2)[None, :], x[:, None], tl.where(fresh, 0.0, later))
        return y * tl.sigmoid(y), new

    @triton.jit
    def _conv_step(row, cw_ptr, win, s_chan, ch, fresh, W: tl.constexpr, BW: tl.constexpr):
        """:func:`_conv` of channels ``ch`` of the projection row, their windows read here."""
        u, later = _window(win, s_chan, ch, W, BW)
        return _conv(tl.load(row + ch).to(tl.float32), u, later, cw_ptr, ch, fresh, W, BW)

    @triton.jit
    def carried_state(slot_ptr, fresh_ptr, pid, state_ptr, s_state, win_ptr, s_wslot, s_wchan, h, i, j, P,
                      K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr):
        """What a program reads of its sequence's carried state before the wait for the kernel before: the slot
        and fresh flag (step inputs, in place before the step's first kernel), the head's state at columns ``j``
        and the q, k and v windows of its channels. The layer's state and windows are written by this kernel
        alone, in the step before, so the kernel before cannot have touched them; the projection row, which it
        writes, is read after the wait. Returns the sequence's row, fresh flag, state rows and windows' addresses,
        then what they read."""
        b = pid.to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        fresh = tl.load(fresh_ptr + b) != 0
        rows = state_ptr + slot * s_state + h * K * K + i[:, None] * K  # the head's [K, V] state, by rows
        win = win_ptr + slot * s_wslot
        uq, lq = _window(win, s_wchan, h * K + i, W, BW)
        uk, lk = _window(win, s_wchan, P + h * K + i, W, BW)
        uv, lv = _window(win, s_wchan, 2 * P + h * K + j, W, BW)
        return b, fresh, rows, win, tl.load(rows + j[None, :]), uq, lq, uk, lk, uv, lv

    @triton.jit
    def head_arrival(count_ptr, b, h, H, NV: tl.constexpr, PERIOD: tl.constexpr):
        """This program's arrival at its (sequence, head)'s counter, after its reads of the head's q and k windows
        (the acquire-release atomic orders them before it): whether it is the head's last program to arrive, the
        one to write those windows. The counter is this kernel's own (no other kernel touches it, and this one's
        launch before has finished), so the arrival need not wait for the kernel before."""
        step = PERIOD // NV
        tl.debug_barrier()  # every thread's window loads performed before the one thread's atomic releases them
        done = tl.atomic_add(count_ptr + b * H + h, step, sem="acq_rel")
        return ((done + step) & (PERIOD - 1)) == 0

    @triton.jit
    def _kda_decode_kernel(proj_ptr, s_proj, cw_ptr, win_ptr, s_wslot, s_wchan, up_ptr, f_ptr, s_f, og_ptr,
                           a_ptr, dtb_ptr, state_ptr, s_state, o_ptr, slot_ptr, fresh_ptr, count_ptr, P, scale,
                           lower, K: tl.constexpr, NV: tl.constexpr, BV: tl.constexpr, BC: tl.constexpr,
                           W: tl.constexpr, BW: tl.constexpr, UP: tl.constexpr, LOWER: tl.constexpr,
                           PRELOAD: tl.constexpr, PDL: tl.constexpr, PERIOD: tl.constexpr):
        h = tl.program_id(1)
        i = tl.arange(0, K)
        j0 = tl.program_id(2) * BV  # this program's first value column; its BV columns go in chunks of BC
        hk = h * K + i  # the head's channels within a group of P
        hv = h * K + j0 + tl.arange(0, BV)
        # the head's rows of the forget gate's up-projection, this program's rows of the output gate's
        wf_rows, wg_rows = up_ptr + hk[:, None] * K, up_ptr + P * K + hv[:, None] * K
        if PRELOAD:  # model weights: read while the kernel before still runs
            wf = weight_tile(wf_rows, i, i < K, K, True)
            wg = weight_tile(wg_rows, i, hv >= 0, K, True)
        jc = tl.arange(0, BC)
        # the sequence's state and windows (its first chunk of columns), not written by the kernel before either
        b, fresh, rows, win, S, uq, lq, uk, lk, uv, lv = carried_state(
            slot_ptr, fresh_ptr, tl.program_id(0), state_ptr, s_state, win_ptr, s_wslot, s_wchan, h, i, j0 + jc, P,
            K, W, BW)
        if NV > 1:  # the head's last program to arrive writes its q and k windows (after every program read them)
            last = head_arrival(count_ptr, b, h, tl.num_programs(1), NV, PERIOD)
        grid_dependency(PDL)
        H = tl.num_programs(1)
        dt = proj_ptr.dtype.element_ty
        wdt = win_ptr.dtype.element_ty
        row = proj_ptr + b * s_proj
        gates = row + 3 * P  # [f_a | g_a | b]
        # the loads that wait on the projection row: the gates' inputs, then the conv's inputs
        if UP:
            if not PRELOAD:
                wf = weight_tile(wf_rows, i, i < K, K, True)
                wg = weight_tile(wg_rows, i, hv >= 0, K, True)
            fa = tl.load(gates + i).to(tl.float32)
            ga = tl.load(gates + K + i).to(tl.float32)
        else:
            f = tl.load(f_ptr + b * s_f + hk).to(tl.float32)
        dtb = tl.load(dtb_ptr + hk).to(tl.float32)
        a = tl.exp(tl.load(a_ptr + h).to(tl.float32))
        beta = tl.sigmoid(tl.load(gates + 2 * K + h).to(tl.float32))
        q, wq = _conv(tl.load(row + hk).to(tl.float32), uq, lq, cw_ptr, hk, fresh, W, BW)
        k, wk = _conv(tl.load(row + P + hk).to(tl.float32), uk, lk, cw_ptr, P + hk, fresh, W, BW)
        vc = 2 * P + h * K + j0 + jc
        v, wv = _conv(tl.load(row + vc).to(tl.float32), uv, lv, cw_ptr, vc, fresh, W, BW)
        q, k = q.to(dt).to(tl.float32), k.to(dt).to(tl.float32)

        if UP:
            f = tl.sum(wf.to(tl.float32) * fa[None, :], 1).to(dt).to(tl.float32)
            og = tl.sum(wg.to(tl.float32) * ga[None, :], 1)
            tl.store(og_ptr + b * P + hv, og.to(og_ptr.dtype.element_ty))
        x = f + dtb
        if LOWER:
            g = lower * tl.sigmoid(a * x)
        else:
            g = -a * softplus(x)
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        decay = tl.exp(g)[:, None]
        col = tl.arange(0, BW)
        keep = (col < W - 1)[None, :]
        # the delta rule a chunk of columns at a time (columns are independent): the next chunk's state and v
        # window are asked for before this one's arithmetic, so a program's memory traffic overlaps its work and
        # it holds two chunks, not the head's whole state
        for c in tl.static_range(BV // BC):
            j = j0 + c * BC + jc
            if c + 1 < BV // BC:
                S_next = tl.load(rows + (j + BC)[None, :])
                v_next, wv_next = _conv_step(row, cw_ptr, win, s_wchan, 2 * P + h * K + j + BC, fresh, W, BW)
            v = v.to(dt).to(tl.float32)
            S = tl.where(fresh, 0.0, S) * decay
            err = v - tl.sum(S * k[:, None], 0)  # v - S^T k
            S += (beta * k)[:, None] * err[None, :]
            tl.store(rows + j[None, :], S)
            tl.store(o_ptr + (b * H + h) * K + j, tl.sum(S * q[:, None], 0).to(o_ptr.dtype.element_ty))
            # the chunk's new v windows: these columns are this program's own; every thread has read their old
            # windows (in the iteration before, or above) before any is written
            tl.debug_barrier()
            tl.store(win + (2 * P + h * K + j)[:, None] * s_wchan + col[None, :], wv.to(wdt), mask=keep)
            if c + 1 < BV // BC:
                S, v, wv = S_next, v_next, wv_next

        # q's and k's new windows, last: they are read by every program of the head, so the last of them to
        # arrive (before the wait) writes them
        if NV > 1:
            keep_qk = keep & last
        else:
            keep_qk = keep
        tl.store(win + hk[:, None] * s_wchan + col[None, :], wq.to(wdt), mask=keep_qk)
        tl.store(win + (P + hk)[:, None] * s_wchan + col[None, :], wk.to(wdt), mask=keep_qk)


def _splits(B: int, H: int, K: int) -> int:
    """Programs per head: enough (sequence, head, columns) programs to spread over the GPU, columns of 16 or more.
    A head stays whole once sequences x heads fill the device: on the H200 at 32 and 64 sequences (H 16, K 128)
    splits of 2 and 4 took 1.2-1.4x the whole head's time (each split repeats the head's conv, norms and gate,
    and reads its state in shorter rows; ``benchmarks/kda_decode.py``), where at one sequence 4 took 0.7x. At one
    sequence behind the input projection (H100), splits of 1, 2, 4 and 8 added 11.9, 10.3, 9.5 and 8.7 us."""
    nv = 1
    while nv * 2 * MIN_COLS <= K and B * H * nv < TARGET_PROGRAMS:
        nv *= 2
    return nv


def _chunk(bv: int) -> int:
    """Value columns a program updates at a time, of its ``bv``: :data:`CHUNK_COLS`, or all of them if fewer."""
    return min(bv, CHUNK_COLS)


def _early(options: dict, up: bool) -> dict:
    """Launch options: the gates' weights read before the wait only where the programs read them (``UP``)."""
    return {**options, "PRELOAD": options["PRELOAD"] and up}


_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, the layer's state pool's address, rows, heads) -> counters


def _counter_key(state_pool: torch.Tensor) -> tuple:
    return state_pool.device, state_pool.data_ptr(), state_pool.shape[0], state_pool.shape[1]


def _counters(state_pool: torch.Tensor) -> torch.Tensor:
    key = _counter_key(state_pool)  # the shape too: a freed pool's address may come back as another's
    if key not in _COUNTERS:
        # one per (sequence, head): a step's sequences each hold a slot of the pool, so rows x heads always do
        _COUNTERS[key] = torch.zeros(state_pool.shape[0] * state_pool.shape[1], dtype=torch.int32,
                                     device=state_pool.device)
    return _COUNTERS[key]


def refusal(proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, lower_bound, scale, state_pool, batch):
    """Why the one-launch kernel cannot run this call, or None."""
    why = triton_refusal(proj)
    if why is not None:
        return why
    if not batch.is_decode:
        return NOT_DECODE
    if state_pool.dtype != torch.float32 or state_pool.dim() != 4 or not state_pool[0].is_contiguous():
        return "the state pool must be fp32 [slots, H, K, V] with contiguous slots"
    H, K, V = state_pool.shape[1:]
    if K != V or K != next_pow2(K) or not 16 <= K <= 128:
        return f"the kernel holds a head's [K, V] state whole: K = V, a power of two in [16, 128], got {K} x {V}"
    try:
        P = split_projection(proj, state_pool)[2]
    except ValueError as e:
        return str(e)
    if proj.stride(-1) != 1:
        return "the projection's columns must be contiguous"
    W = conv_pool.shape[-1] + 1
    if conv_pool.dim() != 3 or conv_pool.shape[1] != 3 * P or conv_pool.stride(-1) != 1 or W > MAX_TAPS:
        return f"the conv windows must be [slots, 3P, W-1] with contiguous columns and at most {MAX_TAPS} taps"
    if conv_weight.numel() != 3 * P * W or not conv_weight.is_contiguous():
        return "the conv weight must be a contiguous [3P, W]"
    if gate_up.shape != (2, P, K) or not gate_up.is_contiguous() or gate_up.dtype != proj.dtype:
        return "the gates' up-projections must be one contiguous [2, P, K] in the projection's dtype"
    if A_log.numel() != H or dt_bias.numel() != P or not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        return "A_log must be H contiguous values and dt_bias P"
    if _splits(proj.shape[0], H, K) > 1 and _counter_key(state_pool) not in _COUNTERS:
        if state_pool.is_cuda and torch.cuda.is_current_stream_capturing():
            return "this layer's first call is inside a CUDA-graph capture (its counters are made eagerly)"
        _counters(state_pool)
    return None


@register("kda_decode", "cuda", verifier=refusal, note="Triton, one launch per decode step")
def kda_decode(proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, lower_bound, scale, state_pool, batch):
    H, K, P = split_projection(proj, state_pool)
    B, W = proj.shape[0], conv_pool.shape[-1] + 1
    o = torch.empty(B, H, K, dtype=proj.dtype, device=proj.device)
    up = B <= UP_MAX_ROWS
    if up:
        og = torch.empty(B, P, dtype=proj.dtype, device=proj.device)
        f = og  # not read
    else:
        fg = gate_ups(proj[:, 3 * P:3 * P + 2 * K], gate_up)
        f, og = fg[0], fg[1]
    nv = _splits(B, H, K)
    if B:
        _kda_decode_kernel[(B, H, nv)](
            proj, proj.stride(0), conv_weight, conv_pool, conv_pool.stride(0), conv_pool.stride(1), gate_up, f,
            f.stride(0), og, A_log, dt_bias, state_pool, state_pool.stride(0), o, batch.state_slots, batch.fresh,
            _counters(state_pool) if nv > 1 else batch.fresh, P, float(scale), float(lower_bound or 0.0), K=K,
            NV=nv, BV=K // nv, BC=_chunk(K // nv), W=W, BW=next_pow2(W - 1), UP=up, LOWER=lower_bound is not None,
            PERIOD=COUNT_PERIOD, num_warps=8 if K >= 64 else 4, **_early(preload(proj, gate_up), up))
    return o, og
