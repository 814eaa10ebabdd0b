"""``mla_latent_write``: the Triton kernel (Triton's interpreter on the CPU) writes exactly the rows the reference
writes (norm, rotary, concatenation, scatter), with and without the rotary, both pair layouts, views of a wider
projection, odd widths and a pool of another dtype; slots it does not write keep their bytes."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.attention import latent, latent_kernels as K

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, R, P, dtype, pool_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(T, R + P + 24, generator=g).to(dtype).to(DEV)  # a wider fused projection's output
    c_kv, k_pe = proj[:, :R], proj[:, R:R + P]
    weight = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype).to(DEV)
    angles = torch.rand(T, P // 2, generator=g) * 6
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    pool = torch.randn(5, 4, R + P, generator=g).to(pool_dtype).to(DEV)
    slots = torch.randperm(20, generator=g)[:T].to(DEV)
    return c_kv, weight, k_pe, cos, sin, pool, slots


@pytest.mark.parametrize("T,R,P", [(1, 512, 64), (3, 48, 16), (7, 300, 6)], ids=str)
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("rope", ["neox", "interleaved", "none"])
def test_the_kernel_writes_the_reference_rows(T, R, P, dtype, pool_dtype, rope):
    c_kv, weight, k_pe, cos, sin, pool, slots = _case(T, R, P, dtype, pool_dtype)
    if rope == "none":
        cos = sin = None
    args = (c_kv, weight, 1e-6, k_pe, cos, sin, rope == "interleaved")
    assert K._refusal(*args, pool, slots) is None
    want, got = pool.clone(), pool.clone()
    latent.mla_latent_write(*args, want, slots)
    K.mla_latent_write(*args, got, slots)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the same math; bf16 may round one ulp apart
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    others = torch.ones(20, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(got.view(20, -1)[others.to(DEV)], pool.view(20, -1)[others.to(DEV)])
    assert not torch.equal(got, pool)


def test_refusals_leave_the_reference_to_run():
    c_kv, weight, k_pe, cos, sin, pool, slots = _case(2, 32, 8, torch.float32, torch.float32)
    args = (c_kv, weight, 1e-6, k_pe, cos, sin, False)
    assert "quantised" in K._refusal(*args, object(), slots)
    assert "contiguous" in K._refusal(*args, pool[:, :, :-8], slots)
    assert "P/2" in K._refusal(c_kv, weight, 1e-6, k_pe, cos[:, :2], sin[:, :2], False, pool, slots)
    assert "dtype" in K._refusal(c_kv, weight, 1e-6, k_pe.bfloat16(), cos, sin, False, pool, slots)
