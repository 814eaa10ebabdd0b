"""MXFP4 round trips against the OCP MX definition, and against transformers' own dequantizer."""
from __future__ import annotations

import pytest
import torch

from dayzero.quant.mxfp4 import FP4_VALUES, dequantize_mxfp4, packed_nbytes, quantize_mxfp4


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def test_every_e2m1_code_decodes_to_the_ocp_value():
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 elements: every code twice
    blocks = _pack(codes).view(1, 16)
    out = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)  # scale 2^0
    assert out.tolist() == [FP4_VALUES[c] for c in codes.tolist()]
    assert torch.signbit(out[8]) and out[8] == 0  # code 8 is -0


def test_low_nibble_holds_the_even_element():
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x72  # element 0: code 2 (1.0), element 1: code 7 (6.0)
    out = dequantize_mxfp4(blocks, torch.tensor([127], dtype=torch.uint8), torch.float32)
    assert out[0].item() == 1.0 and out[1].item() == 6.0


@pytest.mark.parametrize("e", [0, 1, 126, 127, 128, 200, 254], ids=lambda e: f"e{e}")
def test_scale_extremes(e):
    blocks = _pack(torch.full((32,), 1, dtype=torch.uint8)).view(1, 16)  # every element 0.5
    out = dequantize_mxfp4(blocks, torch.tensor([e], dtype=torch.uint8), torch.float32)
    assert torch.equal(out, torch.full((32,), 0.5 * 2.0 ** (e - 127)))


def test_every_byte_at_every_scale_is_the_definition():
    """All 256 packed bytes (both nibbles) at all 256 scales: E2M1 value x 2^(s - 127) rounded to fp32 (exact,
    down to the subnormals; inf past fp32's range; NaN at 0xFF), element 2j from the low nibble."""
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16)  # 16 blocks of 16 bytes: every byte once
    for s in range(256):
        out = dequantize_mxfp4(blocks, torch.full((16,), s, dtype=torch.uint8), torch.float32).view(256, 2)
        if s == 255:
            assert torch.isnan(out).all()
            continue
        want = torch.tensor([[FP4_VALUES[b & 15] * 2.0 ** (s - 127), FP4_VALUES[b >> 4] * 2.0 ** (s - 127)]
                             for b in range(256)], dtype=torch.float32)
        assert torch.equal(out, want) and torch.equal(torch.signbit(out), torch.signbit(want)), s


def test_nan_scale_gives_nan():
    out = dequantize_mxfp4(torch.zeros(1, 16, dtype=torch.uint8), torch.tensor([255], dtype=torch.uint8), torch.float32)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("k", [-20, -3, 0, 5, 60], ids=lambda k: f"k{k}")
def test_representable_values_round_trip_exactly(k):
    g = torch.Generator().manual_seed(k + 100)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    codes[:, 0] = 7  # amax 6 * 2^k pins the block scale to 2^k
    codes[:, 32] = 15
    vals = torch.tensor(FP4_VALUES)[codes] * 2.0**k
    blocks, scales = quantize_mxfp4(vals)
    assert scales.tolist() == [[127 + k] * 2] * 4
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), vals)


def test_rounding_is_nearest_ties_to_even_and_saturates():
    # scale 2^0 (amax 6); probes between grid points
    probes = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 2.9, -0.75, -5.0]
    expect = [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, 3.0, -1.0, -4.0]
    x = torch.tensor(probes + [0.0] * (32 - len(probes)))
    out = dequantize_mxfp4(*quantize_mxfp4(x), torch.float32)
    assert out[: len(probes)].tolist() == expect
    # 7 is above the largest magnitude at scale 2^0 only when amax sets scale 2^0; here amax = 7 -> scale 2^0, saturate
    sat = torch.tensor([7.0] + [1.0] * 31)
    assert dequantize_mxfp4(*quantize_mxfp4(sat), torch.float32)[0].item() == 6.0


def test_random_weights_error_bound_and_size():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (8, 8, 16) and blocks.dtype == torch.uint8 and scales.shape == (8, 8)
    assert blocks.numel() + scales.numel() == packed_nbytes(w.numel())
    back = dequantize_mxfp4(blocks, scales, torch.float32)
    # X = 2^(floor(log2 amax) - 2): amax < 8X, values above 6X saturate (error < 2X), others round (error <= X)
    X = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    assert ((back - w).abs() <= 2 * X).all()
    assert ((back - w).abs() <= X)[w.abs() <= 6 * X].all()
    rel = ((back - w).norm() / w.norm()).item()
    assert rel < 0.2, rel  # 4-bit: about 10% relative error on Gaussian weights


def test_zero_block():
    blocks, scales = quantize_mxfp4(torch.zeros(32))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), torch.zeros(32))


def test_matches_transformers_dequantizer():
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    w = torch.randn(3, 10, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)  # [E, N, K/32, 16], [E, N, K/32]
    ref = mx.convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, K, N] (transposed)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    torch.testing.assert_close(ours, ref.transpose(-1, -2), rtol=0, atol=0)
