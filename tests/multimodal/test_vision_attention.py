"""vision_attention: the reference against one dense softmax with a block-diagonal mask, the cuda
implementation against the reference, and the registry's choice."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops import call, registered
from dayzero.ops.attention.vision import vision_attention, vision_attention_sdpa
from dayzero.ops.registry import choose

# Tolerances per dtype: (max-abs, relative). bf16 inputs are compared with fp64 math on the same rounded
# inputs, so only the output rounding remains.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}
# Segment lengths: one image, images of different sizes, single-row segments, an empty segment.
SEGMENTS = [[16], [12, 5, 33], [1, 1, 7], [9, 0, 4], [70]]


def dense_attention(q, k, v, lengths, scale):
    """Full [H, N, N] fp64 scores with every cross-segment pair masked out."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = seg[:, None] == seg[None, :]
    s = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * scale
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", p, v.double())


def make(lengths, H, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    N = sum(lengths)
    q, k, v = (torch.randn(N, H, D, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return q, k, v, cu.to(device)


def check_close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    err = (out.double().cpu() - ref.double().cpu()).abs()
    assert err.max().item() <= atol + rtol * ref.abs().max().item(), f"max abs error {err.max().item():.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H,D", [(1, 8), (4, 16), (3, 72)], ids=lambda x: str(x))
@pytest.mark.parametrize("lengths", SEGMENTS, ids=lambda ls: "L" + "-".join(map(str, ls)))
def test_reference_matches_dense(lengths, H, D, dtype):
    q, k, v, cu = make(lengths, H, D, dtype)
    out = vision_attention(q, k, v, cu, D**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    check_close(out, dense_attention(q, k, v, lengths, D**-0.5), dtype)


@pytest.mark.parametrize("q_block", [1, 5, 64])
def test_query_blocks_give_the_same_result(q_block):
    q, k, v, cu = make([40, 3, 17], 2, 8, torch.float32)
    ref = dense_attention(q, k, v, [40, 3, 17], 0.3)
    check_close(vision_attention(q, k, v, cu, 0.3, q_block=q_block), ref, torch.float32)


def test_no_rows():
    q = torch.zeros(0, 2, 8)
    assert vision_attention(q, q, q, torch.zeros(1, dtype=torch.int32), 1.0).shape == (0, 2, 8)


@pytest.mark.parametrize("cu", [[0, 5], [1, 10], [0, 6, 4, 10], []], ids=["short", "not-from-0", "falling", "empty"])
def test_bad_cu_seqlens(cu):
    q, k, v, _ = make([10], 2, 8, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        vision_attention(q, k, v, torch.tensor(cu, dtype=torch.int32), 1.0)


def test_registered_and_cpu_takes_the_reference():
    assert {"reference", "cuda"} <= set(registered()["vision_attention"].impls)
    q, k, v, cu = make([4, 4], 2, 8, torch.float32)
    chosen, _, reason = choose("vision_attention", "cuda", q, k, v, cu, 1.0)
    assert chosen == "reference" and "cpu" in reason  # the SDPA verifier refuses host tensors, saying so
    check_close(call("vision_attention", q, k, v, cu, 0.5), dense_attention(q, k, v, [4, 4], 0.5), torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lengths", SEGMENTS, ids=lambda ls: "L" + "-".join(map(str, ls)))
def test_cuda_matches_reference(lengths, dtype):
    q, k, v, cu = make(lengths, 4, 64, dtype, device="cuda")
    assert choose("vision_attention", "cuda", q, k, v, cu, 0.125)[0] == "cuda"
    out = vision_attention_sdpa(q, k, v, cu, 0.125)
    ref = vision_attention(q, k, v, cu, 0.125)
    check_close(out, ref.float(), dtype)
    check_close(call("vision_attention", q, k, v, cu, 0.125), ref.float(), dtype)
