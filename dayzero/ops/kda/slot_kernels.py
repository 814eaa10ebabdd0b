"""Zeroing the state slots of the sequences that start a step, in one Triton launch that writes only those.

A decode step reads each sequence's state from its slot inside fla's recurrent kernel, so a sequence that starts
there (a one-token prompt, the padding rows of a captured step) needs its slot zeroed first. Zeroing
``where(fresh, slot, 0)`` with ``index_fill_`` wrote a whole state (1 MB for 16 heads of 128 x 128 fp32) for
every row, most of them into the null slot, in every KDA layer of every step; here a program per (row, block of
the state) loads the row's flag and writes nothing unless it is set.
"""
from __future__ import annotations

import torch

from dayzero.ops.triton_support import HAS_TRITON, pdl, triton_refusal

if HAS_TRITON:
    import triton
    import triton.language as tl

    from dayzero.ops.triton_support import grid_dependency

BLOCK = 4096  # state elements a program zeroes

if HAS_TRITON:
    @triton.jit
    def _zero_fresh_kernel(pool_ptr, slot_ptr, fresh_ptr, N, s_slot, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # pool: [slots, N] (rows s_slot apart, unit column stride); slot, fresh: [B]; grid: B x cdiv(N, BLOCK)
        grid_dependency(PDL)
        b = tl.program_id(0)
        if tl.load(fresh_ptr + b) != 0:
            slot = tl.load(slot_ptr + b).to(tl.int64)
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            zero = tl.zeros((BLOCK,), dtype=pool_ptr.dtype.element_ty)
            tl.store(pool_ptr + slot * s_slot + cols, zero, mask=cols < N)


def refusal(pool: torch.Tensor) -> str | None:
    why = triton_refusal(pool)
    if why is not None:
        return why
    if pool[0].numel() and not pool[0].is_contiguous():
        return "each slot's state must be contiguous"
    return None


def zero_fresh_slots(pool: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> None:
    """``pool[slots[b]] = 0`` for every ``b`` with ``fresh[b]``; the other slots are not written."""
    # pool: [slots, ...]; slots: [B] int; fresh: [B] bool
    B, N = slots.shape[0], pool[0].numel()
    if B and N:
        _zero_fresh_kernel[(B, triton.cdiv(N, BLOCK))](pool, slots, fresh, N, pool.stride(0), BLOCK=BLOCK,
                                                       num_warps=4, **pdl(pool))
