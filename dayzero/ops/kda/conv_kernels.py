"""The short causal depthwise conv over the window pool as one Triton kernel, for decode and prefill rows.

One program per (sequence, block of channels) walks its sequence's tokens in tiles: tap j of token t reads
u_{t-W+1+j}, which is an input row of this step when it falls inside the sequence and otherwise a column of
the sequence's window in the pool (zeros for a ``fresh`` sequence). After its last tile the program writes the
sequence's new window (its last W-1 inputs) back into the same slot, in place, behind a barrier, so that the
threads that read the old window have finished before any writes it. Each program owns its (slot, channels),
so programs never race; padding rows of a captured step share the null slot 0, which nothing reads. Given the
layer's recurrent state pool (``reset``), the programs of a fresh sequence also zero its slot there, a share
each: the delta rule that follows needs no launch of its own for it.

Token counts come from ``cu_seqlens`` on the device: no host value is read, and the same kernel runs inside a
captured decode graph and on an eager prefill step. Same math as ``reference.py`` (fp32 taps, SiLU).
"""
from __future__ import annotations

import torch

from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton, triton_refusal

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _conv_kernel(x_ptr, w_ptr, pool_ptr, y_ptr, cu_ptr, slot_ptr, fresh_ptr, C, CG, sx, s_yg, s_slot, s_chan,
                     reset_ptr, reset_n, s_reset,
                     W: tl.constexpr, BW: tl.constexpr, SILU: tl.constexpr, DECODE: tl.constexpr,
                     BT: tl.constexpr, BC: tl.constexpr, RESET: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        b = tl.program_id(0)
        if RESET:  # a fresh sequence's slot of the layer's other state pool: this program's share of it zeroed
            if tl.load(fresh_ptr + b) != 0:
                share = tl.cdiv(reset_n, tl.num_programs(1))
                lo = tl.program_id(1) * share
                row = reset_ptr + tl.load(slot_ptr + b).to(tl.int64) * s_reset
                for i0 in range(0, share, RB):
                    i = lo + i0 + tl.arange(0, RB)
                    tl.store(row + i, tl.zeros((RB,), dtype=reset_ptr.dtype.element_ty),
                             mask=(i < lo + share) & (i < reset_n))
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cols < C
        y_cols = (cols // CG) * s_yg + cols % CG  # y is [C/CG groups, T, CG]: group g's channels contiguous
        if DECODE:  # row b is sequence b's one token
            start = b.to(tl.int64)
            end = start + 1
        else:
            start = tl.load(cu_ptr + b).to(tl.int64)
            end = tl.load(cu_ptr + b + 1).to(tl.int64)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        # a fresh sequence starts from a zero window: its window columns (src < start) are never read. Folded into
        # the bound rather than and-ed in as a scalar mask (Triton 3.9's interpreter rejects that mask)
        lim = start - W * tl.load(fresh_ptr + b).to(tl.int64)
        win = pool_ptr + slot * s_slot + cols[None, :] * s_chan  # [1, BC]: column i holds u_{start-W+1+i}
        t0 = start
        while t0 < end:  # a while loop: the interpreter cannot take device bounds in range()
            t = t0 + tl.arange(0, BT)
            tmask = t < end
            acc = tl.zeros((BT, BC), dtype=tl.float32)
            for j in tl.static_range(W):
                src = t - (W - 1) + j  # [BT]
                inside = src >= start
                m_x = (tmask & inside)[:, None] & cmask[None, :]
                u = tl.load(x_ptr + src[:, None] * sx + cols[None, :], mask=m_x, other=0.0).to(tl.float32)
                m_w = (tmask & (src < lim))[:, None] & cmask[None, :]
                widx = (src - start + (W - 1))[:, None]
                u += tl.load(win + widx, mask=m_w, other=0.0).to(tl.float32)
                acc += u * tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0).to(tl.float32)[None, :]
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(y_ptr + t[:, None] * CG + y_cols[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=tmask[:, None] & cmask[None, :])
            t0 += BT
        # the new window: the last W-1 inputs of [old window | this step's rows]
        i = tl.arange(0, BW)
        src = end - (W - 1) + i  # [BW]
        valid = i < W - 1
        inside = src >= start
        m_x = (valid & inside)[:, None] & cmask[None, :]
        new = tl.load(x_ptr + src[:, None] * sx + cols[None, :], mask=m_x, other=0.0).to(tl.float32)
        m_w = (valid & (src < lim))[:, None] & cmask[None, :]
        new += tl.load(win + (src - start + (W - 1))[:, None], mask=m_w, other=0.0).to(tl.float32)
        tl.debug_barrier()
        tl.store(win + i[:, None], new.to(pool_ptr.dtype.element_ty), mask=valid[:, None] & cmask[None, :])


MAX_TAPS = 16


def conv_refusal(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor, groups: int = 1,
                 reset: torch.Tensor | None = None) -> str | None:
    """Why the Triton conv cannot run these operands, or None."""
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dim() != 2 or x.stride(-1) != 1:
        return "x must be [T, C] with contiguous channels"
    if groups < 1 or x.shape[1] % groups:
        return f"{x.shape[1]} channels do not cut into {groups} equal groups"
    W = window_pool.shape[-1] + 1
    if W > MAX_TAPS:
        return f"{W} taps exceed the kernel's {MAX_TAPS}"
    if window_pool.stride(-1) != 1 or weight.numel() != x.shape[1] * W:
        return "the window pool's columns are not contiguous, or the weight is not [C, W]"
    if reset is not None and not reset[0].is_contiguous():
        return "the pool to reset needs contiguous slots"
    return None


def causal_conv1d_pooled_triton(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor, batch,
                                activation: str | None = "silu", groups: int = 1,
                                reset: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, C] (rows may be strided); weight: [C, W] (or [C, 1, W]); window_pool: [slots, C, W-1]
    # -> y [T, C], or [groups, T, C / groups] written group by group. reset: another pool [slots, ...] (the
    # layer's recurrent states, rows contiguous) whose fresh sequences' slots the same launch zeroes
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    T, C = x.shape
    W = window_pool.shape[-1] + 1
    w = weight.reshape(C, W)
    if not w.is_contiguous():
        w = w.contiguous()
    CG = C // groups
    y = torch.empty((groups, T, CG) if groups > 1 else (T, C), dtype=x.dtype, device=x.device)
    B = batch.state_slots.shape[0]
    if T and B:
        BC = min(128, next_pow2(C))
        BT = 1 if batch.is_decode else 16
        _conv_kernel[(B, triton.cdiv(C, BC))](
            x, w, window_pool, y, batch.cu_seqlens, batch.state_slots, batch.fresh, C, CG, x.stride(0), T * CG,
            window_pool.stride(0), window_pool.stride(1), window_pool if reset is None else reset,
            0 if reset is None else reset[0].numel(), 0 if reset is None else reset.stride(0), W=W,
            BW=next_pow2(W - 1), SILU=activation == "silu", DECODE=batch.is_decode, BT=BT, BC=BC,
            RESET=reset is not None, RB=1024, num_warps=4, **pdl(x))
    return y
