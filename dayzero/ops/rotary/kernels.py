"""RoPE as one Triton kernel (the reference issues about ten: casts, halves, products, the concatenation).

One program per (token, block of heads) rotates the pairs of every head in the block: NeoX pairs (i, i + D/2)
or interleaved pairs (2i, 2i + 1), in fp32, written in the input's dtype. The input may be a view whose heads
and tokens are strided (the rotated part of a wider head); its channels must be contiguous.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, tl, triton, triton_refusal

if HAS_TRITON:
    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, half, sxt, sxh, sct,
                       INTERLEAVED: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BH + tl.arange(0, BH)
        i = tl.arange(0, BD)
        mask = (h[:, None] < H) & (i[None, :] < half)
        c = tl.load(cos_ptr + t * sct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * sct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        if INTERLEAVED:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        xrow = x_ptr + t * sxt + h[:, None] * sxh
        yrow = y_ptr + t * H * 2 * half + h[:, None] * 2 * half
        x1 = tl.load(xrow + a[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + b[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(yrow + a[None, :], (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(yrow + b[None, :], (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


def _verify(x, cos, sin, interleaved=False) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2:
        return "x must be [T, H, D] with contiguous channels and an even D"
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "cos and sin must be [T, D/2] tables with contiguous columns"
    return None


@register("rotary", "cuda", verifier=_verify, note="Triton")
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, D/2] -> [T, H, D] in x.dtype
    T, H, D = x.shape
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H:
        BD = next_pow2(D // 2)
        BH = max(1, min(next_pow2(H), 2048 // BD))
        _rotary_kernel[(T, triton.cdiv(H, BH))](x, cos, sin, y, H, D // 2, x.stride(0), x.stride(1), cos.stride(0),
                                                INTERLEAVED=interleaved, BH=BH, BD=BD, num_warps=4)
    return y
