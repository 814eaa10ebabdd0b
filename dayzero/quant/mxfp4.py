"""MXFP4 (OCP Microscaling v1.0, ARCHITECTURE.md 4): 32 consecutive elements along the reduction dim share
one E8M0 scale; each element is an E2M1 code. Packed as gpt-oss stores it: ``blocks`` uint8 [..., K/32, 16]
(element 2j in the low nibble of byte j, 2j+1 in the high nibble) and ``scales`` uint8 [..., K/32]
(value 2^(e-127); 0xFF is NaN). 4.25 bits per weight.
"""
from __future__ import annotations

import torch

BLOCK = 32
E8M0_NAN = 0xFF
# E2M1 code -> value; codes 8..15 are the negatives (8 is -0)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MAGNITUDES = torch.tensor(FP4_VALUES[:8])
_EMAX_ELEM = 2  # exponent of the largest E2M1 value (6 = 1.5 * 2^2)
_LUTS: dict[torch.device, torch.Tensor] = {}  # device -> FP4_VALUES there (see fp4_lut)
_PAIRS: dict[torch.device, torch.Tensor] = {}  # device -> the byte -> E4M3 pair table there (see e4m3_pair_table)
_VALUE_PAIRS: dict[torch.device, torch.Tensor] = {}  # device -> the byte -> value pair table (value_pair_table)
_E8M0: dict[torch.device, torch.Tensor] = {}  # device -> the scale byte -> 2^(byte - 127) table (e8m0_table)


def _on_device(cache: dict, device: torch.device | str, build) -> torch.Tensor:
    """``cache``'s table for ``device``, made by ``build()`` on the host and copied there the first time only:
    building it on every call would be a synchronising host-to-device copy, and one that CUDA-graph capture
    forbids."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    table = cache.get(device)
    if table is None:
        table = cache[device] = build().to(device)
    return table


def fp4_lut(device: torch.device | str) -> torch.Tensor:
    """E2M1 code -> value, fp32 [16] on ``device``, built once per device."""
    return _on_device(_LUTS, device, lambda: torch.tensor(FP4_VALUES, dtype=torch.float32))


def _value_pairs() -> torch.Tensor:
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)
    byte = torch.arange(256)
    return torch.stack((values[byte & 15], values[byte >> 4]), dim=-1)


def value_pair_table(device: torch.device | str) -> torch.Tensor:
    """Packed byte -> its two E2M1 values (the low nibble's first), fp32 [256, 2] on ``device``, built once."""
    return _on_device(_VALUE_PAIRS, device, _value_pairs)


def _e8m0_values() -> torch.Tensor:
    out = torch.ldexp(torch.ones(256), torch.arange(256, dtype=torch.int32) - 127)  # 2^-127 (subnormal) .. 2^128
    out[E8M0_NAN] = float("nan")
    return out


def e8m0_table(device: torch.device | str) -> torch.Tensor:
    """E8M0 scale byte -> 2^(byte - 127), fp32 [256] on ``device`` (0xFF: NaN), built once."""
    return _on_device(_E8M0, device, _e8m0_values)


def _e4m3_pairs() -> torch.Tensor:
    codes = torch.tensor(FP4_VALUES).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    byte = torch.arange(256)
    return (codes[byte & 15] | (codes[byte >> 4] << 8)).to(torch.int16)


def e4m3_pair_table(device: torch.device | str) -> torch.Tensor:
    """Packed byte -> its two E2M1 values as E4M3 codes in one int16 (the low nibble's in the low byte), [256]
    on ``device``, built once per device: every E2M1 value is exact in E4M3, so the FP8 workspace conversion is
    one table lookup per byte."""
    return _on_device(_PAIRS, device, _e4m3_pairs)


def _round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 of the E2M1 values nearest to x (already divided by the scale), ties to even code,
    saturating at ±6."""
    mag = x.abs().clamp(max=6.0)
    grid = _MAGNITUDES.to(x.device)
    hi = torch.searchsorted(grid, mag.contiguous(), right=False).clamp(max=7)  # first grid value >= mag
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - grid[lo], grid[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    return code + 8 * (x < 0).to(code.dtype) * (code > 0).to(code.dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K a multiple of 32) -> (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]).

    OCP reference: X = 2^(floor(log2(amax)) - emax_elem), elements RNE(v / X) saturated to ±6."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {tuple(w.shape)}")
    x = w.float().reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(-1)
    exp = torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - _EMAX_ELEM
    exp = exp.clamp(-127, 127)
    scales = (exp + 127).to(torch.uint8)  # [..., G]
    codes = _round_to_e2m1(x / torch.exp2(exp)[..., None]).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., G, 16]
    return blocks.contiguous(), scales.contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(blocks [..., G, 16], scales [..., G]) -> [..., G*32] in ``dtype``. A 0xFF scale gives NaN (OCP).

    Two table lookups and one product: each byte's two values at once, each block's scale as the power of two it
    stands for (a product by a power of two is exact, as ``ldexp`` is, down to fp32's subnormals)."""
    out = block_values(blocks) * scale_values(scales)[..., None]
    return out.flatten(-2).to(dtype)


# index_select over flattened codes: several times faster on CPUs than indexing a table by an n-d tensor
def block_values(blocks: torch.Tensor) -> torch.Tensor:
    """The E2M1 values of packed codes, unscaled: blocks [..., G, 16] -> fp32 [..., G, 32] (element 2j from the low
    nibble of byte j)."""
    vals = value_pair_table(blocks.device).index_select(0, blocks.reshape(-1).long())  # [n * 16, 2]
    return vals.view(*blocks.shape[:-1], BLOCK)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes [...] -> fp32 2^(byte - 127) [...] (0xFF: NaN)."""
    return e8m0_table(scales.device).index_select(0, scales.reshape(-1).long()).view(scales.shape)


def packed_nbytes(numel: int) -> int:
    """Bytes of an MXFP4 tensor of ``numel`` weights: 16 B of codes + 1 B of scale per 32 weights."""
    return numel // BLOCK * 17
