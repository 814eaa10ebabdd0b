"""Block-scaled FP8 (DeepSeek layout): tiles of 128×128 with fp32 scale_inv."""
from __future__ import annotations

import pytest
import torch

from dayzero.quant.fp8 import FP8, dequantize_fp8_blocks, quantize_fp8_blocks


@pytest.mark.parametrize("shape", [(256, 384), (130, 200), (1, 128)], ids=lambda s: f"N{s[0]}-K{s[1]}")
def test_round_trip_error_and_layout(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 30.0  # one outlier affects only its own tile
    w8, s = quantize_fp8_blocks(w)
    assert w8.dtype == FP8 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = dequantize_fp8_blocks(w8, s, torch.float32)
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 0.05
    # the scale of a tile is its amax / 448
    assert s[0, 0].item() == pytest.approx(30.0 / 448, rel=1e-6)


def test_dequantize_formula_by_hand():
    w8 = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(FP8)
    s = torch.tensor([[3.0]])
    assert dequantize_fp8_blocks(w8, s, torch.float32).tolist() == [[3.0, -6.0], [1.5, 12.0]]
