"""``triton_support.round_e4m3``: fp32 rounded to e4m3 values in fp32 arithmetic, the rounding the kernels apply
before casting under Triton's interpreter (whose own cast drops the carry of a rounded-up mantissa). Against
torch's cast (round to nearest, ties to even) over normal and subnormal values and exact ties."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"

if triton_support.HAS_TRITON:
    from dayzero.ops.triton_support import tl, triton

    @triton.jit
    def _cast(x_ptr, y_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        y = triton_support.round_e4m3(tl.load(x_ptr + i))
        tl.store(y_ptr + i, y.to(tl.float8e4nv).to(tl.float32))


def test_equals_torchs_cast():
    g = torch.Generator().manual_seed(0)
    normal = torch.exp(torch.empty(30000).uniform_(-14, 6.1, generator=g)).clamp(max=448)
    subnormal = torch.arange(0, 2048, dtype=torch.float32) * 2**-12  # steps of 2^-12 below 2^-1: subnormals, ties
    ties = (torch.arange(16, 32).float() + 0.5).repeat(100)  # midway between e4m3 neighbours at exponent 4
    x = torch.cat([normal, subnormal, ties, torch.tensor([0.0, 448.0, 31.9, 15.99])])
    x = torch.cat([x, torch.zeros(65536 - x.numel())])
    x[::2] *= -1
    y = torch.empty_like(x)
    y = y.to(DEV)
    _cast[(1,)](x.to(DEV), y, N=x.numel())
    want = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(y.cpu(), want), (x[y.cpu() != want][:5], y.cpu()[y.cpu() != want][:5])
