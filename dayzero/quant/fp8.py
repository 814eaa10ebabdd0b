"""FP8 E4M3: block-scaled weights as DeepSeek-V3 stores them (``weight_scale_inv`` per 128×128 tile,
ARCHITECTURE.md 4) and per-block scaled copies for the expert workspace. The linear layer that keeps its weight
in this format is :class:`dayzero.layers.fp8_linear.BlockFp8Linear`."""
from __future__ import annotations

import torch


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128


def quantize_fp8_blocks(w: torch.Tensor, tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w8 e4m3 [N, K], scale_inv fp32 [ceil(N/tile), ceil(K/tile)]) with w ≈ w8 · scale_inv
    per tile (edge tiles zero-padded for the amax)."""
    N, K = w.shape[-2:]
    nb, kb = -(-N // tile), -(-K // tile)
    padded = torch.zeros(*w.shape[:-2], nb * tile, kb * tile, dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w.float()
    tiles = padded.unflatten(-2, (nb, tile)).unflatten(-1, (kb, tile))  # [.., nb, tile, kb, tile]
    amax = tiles.abs().amax(dim=(-3, -1))  # [.., nb, kb]
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    w8 = q.flatten(-4, -3).flatten(-2, -1)[..., :N, :K].to(FP8)
    return w8.contiguous(), scale


def dequantize_fp8_blocks(w8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          tile: int = TILE) -> torch.Tensor:
    """``W[n, k] = W8[n, k] · S[n // tile, k // tile]``."""
    N, K = w8.shape[-2:]
    s = scale_inv.float().repeat_interleave(tile, dim=-2).repeat_interleave(tile, dim=-1)[..., :N, :K]
    return (w8.float() * s).to(dtype)


def quantize_activations(x: torch.Tensor, group: int = TILE) -> torch.Tensor:
    """x [.., K] through FP8 and back, in fp32: each row's ``group`` consecutive values share the scale
    s = amax / 448, and x / s is rounded to e4m3 (DeepSeek-V3's dynamic activation scheme, ``activation_scheme:
    "dynamic"``). What an FP8 x FP8 product of :class:`TileScaled` weights multiplies."""
    K = x.shape[-1]
    g = -(-K // group)
    padded = torch.zeros(*x.shape[:-1], g * group, dtype=torch.float32, device=x.device)
    padded[..., :K] = x.float()
    groups = padded.unflatten(-1, (g, group))
    amax = groups.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    # tensor-by-tensor divisions, correctly rounded on every device (a Python-number divisor may become a product
    # with its reciprocal), as the kernels divide: near-ties of the e4m3 rounding then go the same way everywhere
    scale = amax / torch.full_like(amax, FP8_MAX)
    q = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale
    return q.flatten(-2)[..., :K]


class TileScaled:
    """Stacked FP8 expert weights with 128×128 tile scales, as DeepSeek stores them: ``data`` [E, N, K]
    e4m3, ``scale_inv`` [E, N/128, K/128]; indexing an expert gives its dequantised fp32 weight (what a
    reference GEMM needs; a fused FP8 kernel reads ``data`` and ``scale_inv`` directly).

    ``fp8_activations``: the product takes the activations through :func:`quantize_activations` first, so a
    kernel multiplies e4m3 by e4m3 on FP8 tensor cores (twice the bf16 rate on Hopper); otherwise the
    activations enter exactly."""

    def __init__(self, data: torch.Tensor, scale_inv: torch.Tensor, fp8_activations: bool = False):
        self.data, self.scale_inv, self.shape = data, scale_inv, data.shape
        self.fp8_activations = fp8_activations

    def __getitem__(self, e: int) -> torch.Tensor:
        return dequantize_fp8_blocks(self.data[e], self.scale_inv[e], torch.float32)


def takes_fp8_activations(w) -> bool:
    """Whether a product with expert weights ``w`` rounds its activations to FP8 first: only
    :class:`TileScaled` weights made with ``fp8_activations``; every other format multiplies them exactly."""
    return isinstance(w, TileScaled) and w.fp8_activations
