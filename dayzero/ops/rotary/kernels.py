"""RoPE as one Triton kernel (the reference issues about ten: casts, halves, products, the concatenation).

One program per (token, block of heads) rotates the pairs of every head in the block: NeoX pairs (i, i + D/2)
or interleaved pairs (2i, 2i + 1), in fp32, written in the input's dtype. The input may be a view whose heads
and tokens are strided (the rotated part of a wider head); its channels must be contiguous.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton, triton_refusal

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, half, sxt, sxh, sct, D_out, start,
                       INTERLEAVED: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
                       PDL: tl.constexpr):
        """Rotates channels start .. start + 2·half of each head; with BP > 0 the head's other D_out - 2·half
        channels are copied through (a partial rotary in one pass, no split and concatenation)."""
        grid_dependency(PDL)
        rotate_heads(tl.program_id(0).to(tl.int64), tl.program_id(1) * BH + tl.arange(0, BH), x_ptr, cos_ptr,
                     sin_ptr, y_ptr, H, half, sxt, sxh, sct, D_out, start, INTERLEAVED, BD, BP)

    @triton.jit
    def rotate_heads(t, h, x_ptr, cos_ptr, sin_ptr, y_ptr, H, half, sxt, sxh, sct, D_out, start,
                     INTERLEAVED: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr):
        """Token t's heads h (those < H) rotated from x into y ([T, H, D_out], contiguous), as
        :func:`_rotary_kernel` describes (also a part of other kernels' programs)."""
        i = tl.arange(0, BD)
        mask = (h[:, None] < H) & (i[None, :] < half)
        c = tl.load(cos_ptr + t * sct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + t * sct + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        if INTERLEAVED:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        xrow = x_ptr + t * sxt + h[:, None] * sxh
        yrow = y_ptr + t * H * D_out + h[:, None] * D_out
        if BP > 0:  # the channels that pass through: j < start, and j >= start + 2·half
            j = tl.arange(0, BP)
            ch = j + tl.where(j >= start, 2 * half, 0)
            pm = (h[:, None] < H) & (ch[None, :] < D_out)
            tl.store(yrow + ch[None, :], tl.load(xrow + ch[None, :], mask=pm, other=0.0), mask=pm)
        xrow += start
        yrow += start
        x1 = tl.load(xrow + a[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xrow + b[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(yrow + a[None, :], (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(yrow + b[None, :], (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=mask)


def refusal(x, cos, sin, interleaved=False, start=None) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    rot = 2 * cos.shape[-1] if start is not None else x.shape[-1]
    if x.dim() != 3 or x.stride(-1) != 1 or x.shape[-1] % 2 or (start is not None and start + rot > x.shape[-1]):
        return "x must be [T, H, D] with contiguous channels, an even D, and the rotated channels inside it"
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "cos and sin must be [T, D/2] tables with contiguous columns"
    return None


@register("rotary", "cuda", verifier=refusal, note="Triton")
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False,
                 start: int | None = None) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, R/2] -> [T, H, D] in x.dtype; R = D unless ``start`` (see reference.apply_rotary)
    T, H, D = x.shape
    half = D // 2 if start is None else cos.shape[-1]
    y = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T and H:
        BD = next_pow2(half)
        BP = 0 if start is None or D == 2 * half else next_pow2(D - 2 * half)
        BH = max(1, min(next_pow2(H), 2048 // max(BD, BP)))
        _rotary_kernel[(T, triton.cdiv(H, BH))](x, cos, sin, y, H, half, x.stride(0), x.stride(1), cos.stride(0),
                                                D, start or 0, INTERLEAVED=interleaved, BH=BH, BD=BD, BP=BP,
                                                num_warps=4, **pdl(x))
    return y
