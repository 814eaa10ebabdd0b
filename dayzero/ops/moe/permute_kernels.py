"""The MoE sort (``moe_permute``) as one Triton launch, for the pair counts of decode and short prefill steps.

The reference sorts the flat (token, slot) pairs by expert with a stable ``argsort`` and counts them with a
``scatter_add_`` and a ``cumsum``: on a GPU about eight kernels, a radix sort among them. Here each pair finds
its sorted row by counting: pair r with expert e_r goes to row

    rank[r] = #{j : e_j < e_r} + #{j < r : e_j = e_r}

(the stable order, exactly ``argsort(stable=True)``'s), and ``order[rank[r]] = r``. Expert e's row end is
``offsets[e] = #{j : e_j <= e}``. One grid: the first programs rank a block of pairs each against every pair
in tiles, the last ones count a block of experts each (and, given a ``load`` buffer, add the row ends to it:
the layer's routed-load counters at no extra launch); nothing is read on the host, so it runs inside CUDA
graphs. The work grows with the square of the pairs, so it serves up to :data:`MAX_PAIRS` of them (2,048
tokens of top-8); longer steps keep the reference's sort.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, pdl, tl, triton, triton_refusal

MAX_PAIRS = 16384
BLOCK_R, BLOCK_J, BLOCK_E = 64, 128, 64  # pairs ranked, pairs compared per step, experts counted per program

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _permute_kernel(ids_ptr, order_ptr, offs_ptr, load_ptr, n, E, rank_programs, HAS_LOAD: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        pid = tl.program_id(0)
        if pid < rank_programs:  # rank BLOCK_R pairs
            r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
            r_ok = r < n
            e_r = tl.load(ids_ptr + r, mask=r_ok, other=0).to(tl.int32)
            rank = tl.zeros((BLOCK_R,), dtype=tl.int32)
            j0 = 0
            while j0 < n:  # a while: the interpreter cannot range() over runtime bounds
                j = j0 + tl.arange(0, BLOCK_J)
                j_ok = j < n
                e_j = tl.load(ids_ptr + j, mask=j_ok, other=0).to(tl.int32)
                before = (e_j[None, :] < e_r[:, None]) | ((e_j[None, :] == e_r[:, None]) & (j[None, :] < r[:, None]))
                rank += tl.sum((before & j_ok[None, :]).to(tl.int32), axis=1)
                j0 += BLOCK_J
            tl.store(order_ptr + rank, r.to(tl.int64), mask=r_ok)
        else:  # count the pairs of experts <= e, for BLOCK_E experts
            e = (pid - rank_programs) * BLOCK_E + tl.arange(0, BLOCK_E)
            e_ok = e < E
            count = tl.zeros((BLOCK_E,), dtype=tl.int32)
            j0 = 0
            while j0 < n:
                j = j0 + tl.arange(0, BLOCK_J)
                j_ok = j < n
                e_j = tl.load(ids_ptr + j, mask=j_ok, other=0).to(tl.int32)
                count += tl.sum(((e_j[None, :] <= e[:, None]) & j_ok[None, :]).to(tl.int32), axis=1)
                j0 += BLOCK_J
            tl.store(offs_ptr + e, count, mask=e_ok)
            if HAS_LOAD:  # one program owns these experts: a plain read-add-write
                prev = tl.load(load_ptr + e, mask=e_ok, other=0)
                tl.store(load_ptr + e, prev + count.to(tl.int64), mask=e_ok)


def refusal(ids: torch.Tensor, num_experts: int, load: torch.Tensor | None = None) -> str | None:
    """Why the Triton sort cannot take ``ids`` [T, k], or None when it can."""
    why = triton_refusal(ids)
    if why is not None:
        return why
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64):
        return "the reference checks these shapes"  # and raises its own error
    if ids.numel() > MAX_PAIRS:
        return f"{ids.numel()} (token, expert) pairs: past {MAX_PAIRS} the reference's sort is faster"
    if num_experts >= 2**31:
        return f"{num_experts} experts do not fit int32 ids"
    if load is not None and (load.dtype != torch.int64 or load.shape != (num_experts,) or not load.is_contiguous()
                             or load.device != ids.device):
        return "the reference checks the load buffer"
    return None


@register("moe_permute", "cuda", verifier=refusal, note="one Triton launch ranking the pairs by counting (up to "
          f"{MAX_PAIRS} pairs; more keep the reference's sort)")
def permute(ids: torch.Tensor, num_experts: int, load: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order int64 [T*k], offsets int32 [E])`` exactly as the reference ``permute`` gives them (and ``load``
    raised by the offsets, as the reference does)."""
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.numel()
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    offsets = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    rank_programs = triton.cdiv(n, BLOCK_R)
    grid = (rank_programs + triton.cdiv(num_experts, BLOCK_E),)
    if grid[0]:
        _permute_kernel[grid](flat, order, offsets, offsets if load is None else load, n, num_experts, rank_programs,
                              HAS_LOAD=load is not None, BLOCK_R=BLOCK_R, BLOCK_J=BLOCK_J, BLOCK_E=BLOCK_E,
                              num_warps=4, **pdl(flat))
    return order, offsets
