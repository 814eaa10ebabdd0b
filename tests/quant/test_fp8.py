"""Block-scaled FP8 (DeepSeek layout): tiles of 128×128 with fp32 scale_inv."""
from __future__ import annotations

import pytest
import torch

from dayzero.quant.fp8 import FP8, dequantize_fp8_blocks, quantize_activations, quantize_fp8_blocks


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


def test_activations_quantised_per_row_and_group_of_128():
    """Each row's 128-wide groups (the last one partial) share amax / 448: the largest value of a group comes back
    (as code 448, up to the scale's fp32 rounding), every value within half an e4m3 step of its own magnitude (normal range), a zero group stays zero."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.exp(torch.randn(5, 1, generator=g) * 3)
    x[2, 128:256] = 0
    q = quantize_activations(x)
    assert q.shape == x.shape and q.dtype == torch.float32
    for lo in (0, 128, 256):
        xs, qs = x[:, lo:lo + 128], q[:, lo:lo + 128]
        amax = xs.abs().amax(-1, keepdim=True)
        top = xs.abs().argmax(-1, keepdim=True)
        assert torch.allclose(qs.gather(-1, top), xs.gather(-1, top), rtol=1e-6, atol=0)  # code 448
        live = amax.squeeze(-1) > 0
        codes = (qs / (amax / 448))[live]  # what was rounded: e4m3 values (up to the division's rounding)
        assert ((codes.to(FP8).float() - codes).abs() <= codes.abs() * 1e-6).all()
        normal = xs.abs() * 448 >= amax * 2**-6  # values whose codes are normal e4m3 numbers
        err = (qs - xs).abs()
        assert (err[normal] <= xs.abs()[normal] * 2**-4 * (1 + 1e-5)).all()
    assert (q[2, 128:256] == 0).all()
    assert not torch.equal(q, x)  # it did round
