"""Norm references against torch.nn.functional computed in fp64."""
import pytest
import torch
import torch.nn.functional as F

from dayzero.ops import call, registered
from dayzero.ops.norm.reference import layer_norm, rms_norm, rms_norm_gated

# max relative error (max|out - ref| / max|ref|) allowed, per output dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

SHAPES = [(13, 96), (1, 7), (0, 16), (3, 5, 129)]  # odd widths, one token, empty batch, leading dims
SHAPE_IDS = ["T13-D96", "T1-D7", "T0-D16", "B3-T5-D129"]
DTYPES = [torch.float32, torch.bfloat16]
EPS = [1e-6, 0.1]  # a large eps so its placement under the sqrt is tested


def assert_close_rel(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == dtype
    if ref.numel() == 0:
        return
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs()
    scale = ref.abs().max().clamp_min(1e-30)
    assert err.max() / scale <= TOL[dtype], f"max rel err {float(err.max() / scale):.3g}"
    torch.testing.assert_close(out.double(), ref, rtol=10 * TOL[dtype], atol=TOL[dtype] * float(scale))


def inputs(shape, dtype, seed, n=1):
    g = torch.Generator().manual_seed(seed)
    D = shape[-1]
    xs = [(torch.randn(shape, generator=g) * 0.7).to(dtype) for _ in range(n)]
    weight = (1 + 0.5 * torch.randn(D, generator=g)).to(dtype)  # not ones, so it must be applied
    return xs, weight


def test_registered():
    for op in ("rms_norm", "rms_norm_gated", "layer_norm"):
        assert op in registered()


@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rms_norm(shape, dtype, eps):
    (x,), w = inputs(shape, dtype, seed=len(shape) + shape[-1])
    y, res = call("rms_norm", x, w, eps)
    assert res is x
    assert_close_rel(y, F.rms_norm(x.double(), (shape[-1],), w.double(), eps), dtype)


@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rms_norm_residual(shape, dtype, eps):
    (x, r), w = inputs(shape, dtype, seed=shape[-1], n=2)
    y, res = rms_norm(x, w, eps, residual=r)
    h = x.double() + r.double()
    # residual_out: the fp32 sum rounded once to the input dtype
    assert res.dtype == dtype
    torch.testing.assert_close(res, h.to(dtype), rtol=0, atol=0)
    # what is normalised is that stored residual, as in an unfused model
    assert_close_rel(y, F.rms_norm(res.double(), (shape[-1],), w.double(), eps), dtype)
    assert_close_rel(y, F.rms_norm(h, (shape[-1],), w.double(), eps), dtype)
    torch.testing.assert_close(y, rms_norm(res, w, eps)[0], rtol=0, atol=0)


@pytest.mark.parametrize("eps", EPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_rms_norm_gated(shape, dtype, eps):
    (x, gate), w = inputs(shape, dtype, seed=3 * shape[-1], n=2)
    gate = gate * 3  # spread the sigmoid over its range
    y = rms_norm_gated(x, w, gate, eps)
    ref = F.rms_norm(x.double(), (shape[-1],), w.double(), eps) * torch.sigmoid(gate.double())
    assert_close_rel(y, ref, dtype)


@pytest.mark.parametrize("eps", [1e-6, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_layer_norm(shape, dtype, eps):
    (x, b), w = inputs(shape, dtype, seed=5 * shape[-1], n=2)
    x = x + 2.0  # a non-zero mean, which must be removed
    bias = b.reshape(-1, shape[-1])[0] if b.numel() else torch.randn(shape[-1]).to(dtype)
    y = call("layer_norm", x, w, bias, eps)
    assert_close_rel(y, F.layer_norm(x.double(), (shape[-1],), w.double(), bias.double(), eps), dtype)


def test_layer_norm_without_affine():
    x = torch.randn(4, 33)
    assert_close_rel(layer_norm(x, None, None, 1e-6), F.layer_norm(x.double(), (33,), eps=1e-6), torch.float32)
