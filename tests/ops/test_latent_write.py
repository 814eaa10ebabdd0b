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
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the same math; bf16 may round an ulp or two apart
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


@pytest.mark.parametrize("T,D,half,start", [(1, 128, 32, 0), (3, 128, 32, 64), (5, 40, 20, None), (2, 72, 8, 3)],
                         ids=str)
@pytest.mark.parametrize("dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
def test_the_index_key_kernel_writes_the_reference_rows(T, D, half, start, dtype, pool_dtype, interleaved):
    g = torch.Generator().manual_seed(1)
    proj = torch.randn(T, D + 40, generator=g).to(dtype).to(DEV)
    k = proj[:, 8:8 + D]  # a view of a wider projection
    weight = (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    bias = (0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV)
    angles = torch.rand(T, half, generator=g) * 6
    cos, sin = angles.cos().to(DEV), angles.sin().to(DEV)
    pool = torch.randn(4, 4, D, generator=g).to(pool_dtype).to(DEV)
    slots = torch.randperm(16, generator=g)[:T].to(DEV)
    args = (k, weight, bias, 1e-6, cos, sin, interleaved, start)
    assert K._index_refusal(*args, pool, slots) is None
    want, got = pool.clone(), pool.clone()
    latent.indexer_key_write(*args, want, slots)
    K.indexer_key_write(*args, got, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a normed value an ulp apart, then rotated
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    others = torch.ones(16, dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(got.view(16, -1)[others.to(DEV)], pool.view(16, -1)[others.to(DEV)])


def test_index_key_refusals():
    k, cos = torch.randn(2, 64, device=DEV), torch.randn(2, 16, device=DEV)
    w, b, pool, slots = torch.ones(64, device=DEV), torch.zeros(64, device=DEV), torch.zeros(2, 4, 64, device=DEV), \
        torch.tensor([1, 2], device=DEV)
    assert K._index_refusal(k, w, b, 1e-6, cos, cos, False, 0, pool, slots) is None
    assert "quantised" in K._index_refusal(k, w, b, 1e-6, cos, cos, False, 0, object(), slots)
    assert "inside" in K._index_refusal(k, w, b, 1e-6, cos, cos, False, 40, pool, slots)
    assert "inside" in K._index_refusal(k, w, b, 1e-6, cos, cos, False, None, pool, slots)  # full needs 2·half = D
    assert "LayerNorm" in K._index_refusal(k, w, None, 1e-6, cos, cos, False, 0, pool, slots)


@pytest.mark.parametrize("T,H,R,P", [(1, 16, 512, 64), (3, 5, 48, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_index", [True, False], ids=["index", "no-index"])
def test_the_step_rows_kernel_does_what_the_three_ops_do(T, H, R, P, dtype, interleaved, with_index):
    """``mla_step_rows``: the query heads' rope channels rotated (read from a view of the heads' queries), the
    latent rows and the indexer keys written, in one launch: equal to the rotary and both writes apart."""
    c_kv, weight, k_pe, cos, sin, pool, slots = _case(T, R, P, dtype, dtype, seed=2)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, H, 24 + P, generator=g).to(dtype).to(DEV)
    q_pe = q[..., 24:]  # the rope channels of each head: a strided view
    index = None
    if with_index:
        D, half = 40, 8
        k = torch.randn(T, D + 8, generator=g).to(dtype).to(DEV)[:, 4:4 + D]
        angles = torch.rand(T, half, generator=g) * 6
        index = (k, (1 + 0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV),
                 (0.1 * torch.randn(D, generator=g)).to(dtype).to(DEV), 1e-6, angles.cos().to(DEV),
                 angles.sin().to(DEV), not interleaved, 8, torch.randn(5, 4, D, generator=g).to(dtype).to(DEV))
    args = (q_pe, c_kv, weight, 1e-6, k_pe, cos, sin, interleaved)
    assert K._step_refusal(*args, pool, slots, index) is None
    want_pool, got_pool = pool.clone(), pool.clone()
    want_index = got_index = None
    if index is not None:
        want_index, got_index = index[8].clone(), index[8].clone()
    want = latent.mla_step_rows(*args, want_pool, slots, index and (*index[:8], want_index))
    got = K.mla_step_rows(*args, got_pool, slots, index and (*index[:8], got_index))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(got_pool.float(), want_pool.float(), rtol=tol, atol=tol)
    assert not torch.equal(got_pool, pool)
    if index is not None:
        torch.testing.assert_close(got_index.float(), want_index.float(), rtol=tol, atol=tol)
        assert not torch.equal(got_index, index[8])


def test_step_rows_refusals():
    c_kv, weight, k_pe, cos, sin, pool, slots = _case(2, 32, 8, torch.float32, torch.float32)
    q_pe = torch.randn(2, 3, 8, device=DEV)
    args = (c_kv, weight, 1e-6, k_pe, cos, sin, False)
    assert K._step_refusal(q_pe, *args, pool, slots) is None
    assert "quantised" in K._step_refusal(q_pe, *args, object(), slots)
    assert "same rotary" in K._step_refusal(torch.randn(2, 3, 4, device=DEV), *args, pool, slots)
    index = (torch.randn(2, 64, device=DEV), torch.ones(64, device=DEV), None, 1e-6, cos, sin, False, 0,
             torch.zeros(2, 4, 64, device=DEV))
    assert "LayerNorm" in K._step_refusal(q_pe, *args, pool, slots, index)
