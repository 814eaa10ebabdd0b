"""The MXFP4 -> workspace conversion as one Triton kernel: each program unpacks a run of 32-value blocks (16
packed bytes of two E2M1 codes each) and writes their values with contiguous stores, scaled by the block's E8M0
scale (bf16 workspace), or as E4M3 codes with the scale beside them (FP8 workspace: every E2M1 value is exact in
E4M3, so each packed byte becomes its two E4M3 codes through a 256-entry table, one 16-bit store, and the
kernel moves bytes at the copy rate; decoding the codes arithmetically cost it 2.5× that time). The bf16 path
looks each code's value up in the 16-entry E2M1 table and scales it. The PyTorch form (``workspace._convert``)
builds int64 indices and fp32 temporaries for the whole layer, about 20 bytes of traffic per weight where this
moves 0.53 in and 1–2 out.

With FP8 activations the FP8 workspace keeps one scale per 128x128 tile (``workspace.tile_shift``): a third
kernel, one program per tile, shifts each block's values by its scale's distance from the tile's largest and
casts them to e4m3.

The E8M0 scale is built from its bits in both (2^(s-127); 0xFF is NaN). Products below fp32's normal range (a
scale byte of 0, 2^-127, that no checkpoint uses) may flush to zero.
"""
from __future__ import annotations

import torch

from dayzero.ops.triton_support import DOT_F32, HAS_TRITON, pdl, tl, triton, triton_refusal
from dayzero.quant.mxfp4 import e4m3_pair_table, fp4_lut

GROUPS_PER_PROGRAM = 256  # 32-value blocks: 4 KiB of packed codes in, 8,192 values out

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _bf16_kernel(blocks_ptr, scales_ptr, out_ptr, n_groups, lut_ptr, GROUPS: tl.constexpr, PDL: tl.constexpr):
        """bf16 workspace: GROUPS 32-value blocks per program, each read as four int32 words of eight codes
        (value 8w + 2b + h of a block is nibble h of byte b of word w, little-endian, so the [GROUPS, 32] values
        come out in order and every store is contiguous); each code's value from the 16-entry table ``lut_ptr``
        (an L1 gather, cheaper than decoding its bits), times the block's scale."""
        grid_dependency(PDL)
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        ok = g < n_groups
        o = tl.arange(0, 32)
        words = blocks_ptr.to(tl.pointer_type(tl.int32))
        word = tl.load(words + g[:, None] * 4 + (o // 8)[None, :], mask=ok[:, None], other=0)
        vals = tl.load(lut_ptr + ((word >> ((o % 8) * 4)[None, :]) & 15))
        s = tl.load(scales_ptr + g, mask=ok, other=127).to(tl.int32)
        bits = tl.where(s == 0, 1 << 22, s << 23)  # 2^(s-127); s = 0 is the subnormal 2^-127
        scale = tl.where(s == 255, float("nan"), bits.to(tl.float32, bitcast=True))
        tl.store(out_ptr + g[:, None] * 32 + o[None, :], (vals * scale[:, None]).to(out_ptr.dtype.element_ty),
                 mask=ok[:, None])

    @triton.jit
    def _fp8_pairs_kernel(blocks_ptr, scales_ptr, out_ptr, scale_out_ptr, n_groups, table_ptr, GROUPS: tl.constexpr,
                          PDL: tl.constexpr):
        """FP8 workspace: each packed byte -> its two E4M3 codes, one int16 from ``table_ptr`` [256]; the block's
        scale written beside as fp32."""
        grid_dependency(PDL)
        g = tl.program_id(0).to(tl.int64) * GROUPS + tl.arange(0, GROUPS)
        ok = g < n_groups
        j = tl.arange(0, 16)
        byte = tl.load(blocks_ptr + g[:, None] * 16 + j[None, :], mask=ok[:, None], other=0).to(tl.int32)
        pairs = tl.load(table_ptr + byte)
        tl.store(out_ptr.to(tl.pointer_type(tl.int16)) + g[:, None] * 16 + j[None, :], pairs, mask=ok[:, None])
        s = tl.load(scales_ptr + g, mask=ok, other=127).to(tl.int32)
        bits = tl.where(s == 0, 1 << 22, s << 23)  # 2^(s-127), as in _bf16_kernel
        tl.store(scale_out_ptr + g, tl.where(s == 255, float("nan"), bits.to(tl.float32, bitcast=True)), mask=ok)


if HAS_TRITON:
    from dayzero.ops.triton_support import round_e4m3

    @triton.jit
    def _fp8_tiles_kernel(blocks_ptr, scales_ptr, out_ptr, scale_out_ptr, lut_ptr, N, G, NT, KT,
                          ROUND_FIRST: tl.constexpr, PDL: tl.constexpr):
        """FP8 workspace in 128x128 tiles (``workspace.tile_shift``): one program per tile of one expert. Its 128
        rows x 4 blocks of scales give the tile's largest m; each block's values (the 16-entry table) times
        2^(s - m + 6) are cast to e4m3 (exact within 14 binades of m), and 2^(m - 133) is the tile's scale."""
        grid_dependency(PDL)
        pid = tl.program_id(0)
        kt = pid % KT
        nt = (pid // KT) % NT
        e = (pid // (KT * NT)).to(tl.int64)
        r = nt * 128 + tl.arange(0, 128)
        g = kt * 4 + tl.arange(0, 4)
        ok = (r[:, None] < N) & (g[None, :] < G)  # [128, 4] 32-blocks of the tile
        blk = (e * N + r.to(tl.int64))[:, None] * G + g[None, :]
        s = tl.load(scales_ptr + blk, mask=ok, other=0).to(tl.int32)
        m = tl.max(tl.max(s, 1), 0)
        f = ((tl.maximum(s - m + 6, -126) + 127) << 23).to(tl.float32, bitcast=True)  # 2^(s - m + 6)
        j = tl.arange(0, 16)
        byte = tl.load(blocks_ptr + blk[:, :, None] * 16 + j[None, None, :], mask=ok[:, :, None], other=0).to(tl.int32)
        pair = tl.join(tl.load(lut_ptr + (byte & 15)), tl.load(lut_ptr + (byte >> 4)))  # [128, 4, 16, 2]
        v = tl.reshape(pair * f[:, :, None, None], (128, 128))
        if ROUND_FIRST:  # under the interpreter (values past 14 binades below m round)
            v = round_e4m3(v)
        col = kt * 128 + tl.arange(0, 128)
        out = out_ptr + (e * N + r.to(tl.int64))[:, None] * (G * 32) + col[None, :]
        tl.store(out, v.to(tl.float8e4nv), mask=(r[:, None] < N) & (col[None, :] < G * 32))
        bits = tl.where(m >= 7, (m - 6) << 23, 1 << (tl.minimum(m, 6) + 16))  # 2^(m - 133), subnormal below m = 7
        inv = tl.where(m == 255, float("nan"), bits.to(tl.float32, bitcast=True))
        tl.store(scale_out_ptr + pid, inv)


def convert_refusal(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out) -> str | None:
    why = triton_refusal(blocks)
    if why is not None:
        return why
    tensors = [blocks, scales, out] + ([scale_out] if scale_out is not None else [])
    if not all(t.is_contiguous() for t in tensors):
        return "the packed weights and the workspace buffers must be contiguous"
    if blocks.data_ptr() % 4 or out.data_ptr() % 2:
        return "the packed weights must start on a 4-byte boundary and the workspace on a 2-byte one"
    return None


def convert_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                  scale_out: torch.Tensor | None) -> None:
    """Unpack [E, N, K/32, 16] codes into ``out`` [E, N, K] (bf16 values, or e4m3 codes with ``scale_out``
    [E, N, K/32] fp32), as ``workspace._convert`` does."""
    n = scales.numel()  # 32-value blocks
    if n and scale_out is not None:
        _fp8_pairs_kernel[(triton.cdiv(n, GROUPS_PER_PROGRAM),)](
            blocks, scales, out, scale_out, n, e4m3_pair_table(blocks.device), GROUPS=GROUPS_PER_PROGRAM, num_warps=4,
            **pdl(blocks))
    elif n:
        _bf16_kernel[(triton.cdiv(n, GROUPS_PER_PROGRAM),)](blocks, scales, out, n, fp4_lut(blocks.device),
                                                            GROUPS=GROUPS_PER_PROGRAM, num_warps=4, **pdl(blocks))


def convert_mxfp4_tiles(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Unpack [E, N, K/32, 16] codes into e4m3 ``out`` [E, N, K] and one fp32 scale per 128x128 tile
    ``scale_out`` [E, ceil(N/128), ceil(K/128)], as ``workspace._convert_tiles_torch`` does."""
    E, N, G = scales.shape
    NT, KT = -(-N // 128), -(-G // 4)
    if E * NT * KT:
        _fp8_tiles_kernel[(E * NT * KT,)](blocks, scales, out, scale_out, fp4_lut(blocks.device), N, G, NT, KT,
                                         ROUND_FIRST=DOT_F32, num_warps=8, **pdl(blocks))
