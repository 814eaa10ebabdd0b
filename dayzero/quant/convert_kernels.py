"""The MXFP4 -> workspace conversion as one Triton kernel: each program unpacks a run of 32-value blocks (16
packed bytes of two E2M1 codes each) and writes their values with contiguous stores, scaled by the block's E8M0
scale (bf16 workspace), or as E4M3 codes with the scale beside them (FP8 workspace: every E2M1 value is exact in
E4M3). The PyTorch form (``workspace._convert``) builds int64 indices and fp32 temporaries for the whole layer,
about 20 bytes of traffic per weight where this moves 0.53 in and 1–2 out.

E2M1 is decoded arithmetically (sign, 2-bit exponent, 1-bit mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6) and the
E8M0 scale built from its bits (2^(s-127); 0xFF is NaN), so the kernel needs no table in memory. Products
below fp32's normal range (a scale byte of 0, 2^-127, that no checkpoint uses) may flush to zero.
"""
from __future__ import annotations

import torch

from dayzero.ops.triton_support import HAS_TRITON, tl, triton, triton_refusal

GROUPS_PER_PROGRAM = 256  # 32-value blocks: 4 KiB of packed codes in, 8,192 values out

if HAS_TRITON:
    @triton.jit
    def _e2m1(code):
        """E2M1 codes (int32 0..15) -> fp32 values."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
        return tl.where(code >= 8, -mag, mag)

    @triton.jit
    def _convert_kernel(blocks_ptr, scales_ptr, out_ptr, scale_out_ptr, n_groups,
                        FP8: tl.constexpr, GROUPS: tl.constexpr):
        """GROUPS 32-value blocks per program, each read as four int32 words of eight codes: value 8w + 2b + h
        of a block is nibble h of byte b of word w (little-endian), so the [GROUPS, 32] values come out in
        order, with no interleaving step, and every store is contiguous."""
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        ok = g < n_groups
        o = tl.arange(0, 32)
        words = blocks_ptr.to(tl.pointer_type(tl.int32))
        word = tl.load(words + g[:, None] * 4 + (o // 8)[None, :], mask=ok[:, None], other=0)
        vals = _e2m1((word >> ((o % 8) * 4)[None, :]) & 15)
        s = tl.load(scales_ptr + g, mask=ok, other=127).to(tl.int32)
        bits = tl.where(s == 0, 1 << 22, s << 23)  # 2^(s-127); s = 0 is the subnormal 2^-127
        scale = tl.where(s == 255, float("nan"), bits.to(tl.float32, bitcast=True))
        if not FP8:
            vals = vals * scale[:, None]
        tl.store(out_ptr + g[:, None] * 32 + o[None, :], vals.to(out_ptr.dtype.element_ty), mask=ok[:, None])
        if FP8:
            tl.store(scale_out_ptr + g, scale, mask=ok)


def convert_refusal(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out) -> str | None:
    why = triton_refusal(blocks)
    if why is not None:
        return why
    tensors = [blocks, scales, out] + ([scale_out] if scale_out is not None else [])
    if not all(t.is_contiguous() for t in tensors):
        return "the packed weights and the workspace buffers must be contiguous"
    if blocks.data_ptr() % 4:
        return "the packed weights must start on a 4-byte boundary (they are read as int32 words)"
    return None


def convert_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                  scale_out: torch.Tensor | None) -> None:
    """Unpack [E, N, K/32, 16] codes into ``out`` [E, N, K] (bf16 values, or e4m3 codes with ``scale_out``
    [E, N, K/32] fp32), as ``workspace._convert`` does."""
    n = scales.numel()  # 32-value blocks
    if n:
        _convert_kernel[(triton.cdiv(n, GROUPS_PER_PROGRAM),)](
            blocks, scales, out, scale_out if scale_out is not None else out, n, FP8=scale_out is not None,
            GROUPS=GROUPS_PER_PROGRAM, num_warps=4)
