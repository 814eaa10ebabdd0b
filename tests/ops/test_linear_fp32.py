"""``linear_fp32`` (router gates, indexer head weights): the Triton form for decode-sized rows against the fp32
reference (odd widths, bias and scale, bf16 and fp32 inputs, row counts across its row tiles), each row's result
the same whatever the other rows of the call, and more rows than it takes left to the reference."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.linear import kernels as K
from dayzero.ops.linear import reference

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,N,Kd", [(1, 64, 96), (5, 33, 200), (17, 7, 64), (40, 128, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,scale", [(False, 1.0), (True, 0.125)])
def test_matches_the_reference(T, N, Kd, dtype, bias, scale):
    g = torch.Generator().manual_seed(T * N + Kd)
    x = torch.randn(T, Kd, generator=g).to(dtype).to(DEV)
    w = torch.randn(N, Kd, generator=g).to(DEV)
    b = torch.randn(N, generator=g).to(DEV) if bias else None
    assert K._verify(x, w, b, scale) is None
    got = K.linear_fp32(x, w, b, scale)
    want = reference.linear_fp32(x, w, b, scale)
    assert got.dtype == torch.float32 and got.shape == (T, N)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_result_alone_and_in_a_batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 256, generator=g).to(torch.bfloat16).to(DEV)
    w = torch.randn(64, 256, generator=g).to(DEV)
    batch = K.linear_fp32(x, w)
    for i in (0, 16, 36):
        assert torch.equal(K.linear_fp32(x[i:i + 1], w), batch[i:i + 1])


def test_leading_dims_and_what_it_leaves_to_the_reference():
    x = torch.randn(2, 3, 32).to(DEV)
    w = torch.randn(8, 32).to(DEV)
    torch.testing.assert_close(K.linear_fp32(x, w), reference.linear_fp32(x, w), rtol=1e-5, atol=1e-5)
    assert "rows" in K._verify(torch.randn(K.MAX_ROWS + 1, 32).to(DEV), w)
    assert "fp32" in K._verify(x, w.to(torch.bfloat16))
    assert "contiguous" in K._verify(torch.randn(4, 64).to(DEV)[:, ::2], w)
