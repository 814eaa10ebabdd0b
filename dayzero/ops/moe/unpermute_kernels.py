"""The MoE weighted sum (``moe_unpermute``) as a gather: each token reads its k expert rows, weights them and
sums in fp32, in one Triton kernel after one scatter that inverts the sort (the reference's ``index_add_``
path issues about eight kernels). The sum over a token's k rows runs in slot order, so the result is the
same from run to run (``index_add_`` on a GPU adds in whatever order its atomics land)."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton, triton_refusal

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _unpermute_kernel(ys_ptr, inv_ptr, w_ptr, out_ptr, L, sy, K: tl.constexpr, BL: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BL + tl.arange(0, BL)
        m = cols < L
        acc = tl.zeros((BL,), dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            w = tl.load(w_ptr + t * K + j).to(tl.float32)
            acc += w * tl.load(ys_ptr + row * sy + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * L + cols, acc.to(out_ptr.dtype.element_ty), mask=m)


def refusal(ys, order, weights, num_tokens) -> str | None:
    why = triton_refusal(ys)
    if why is not None:
        return why
    if ys.dim() != 2 or ys.stride(-1) != 1 or weights.dim() != 2 or order.shape != (ys.shape[0],):
        return "the reference checks these shapes"  # and raises its own error
    if weights.shape[0] != num_tokens or weights.numel() != ys.shape[0]:
        return "the reference checks these shapes"
    if weights.shape[1] > 64:
        return f"{weights.shape[1]} experts per token exceed the kernel's 64"
    return None


@register("moe_unpermute", "cuda", verifier=refusal, note="Triton gather of each token's k rows")
def unpermute(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    # ys: [N, L] rows in expert order; order: [N] flat pair index of each row; weights: [T, k] -> [T, L]
    N, L = ys.shape
    k = weights.shape[1]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(N, device=order.device, dtype=order.dtype)  # pair index -> its sorted row
    out = torch.empty(num_tokens, L, dtype=ys.dtype, device=ys.device)
    w = weights.float().contiguous()
    if num_tokens and L:
        BL = min(1024, next_pow2(L))
        _unpermute_kernel[(num_tokens, triton.cdiv(L, BL))](ys, inv, w, out, L, ys.stride(0), K=k, BL=BL,
                                                           num_warps=4, **pdl(ys))
    return out
