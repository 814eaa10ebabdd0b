"""The Triton grouped-expert kernels against the reference ``moe_experts_grouped``.

On the CPU they run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1) at tiny shapes:
every activation, with and without biases and the clamp limit, every weight format, odd widths, empty
experts, row counts that are not multiples of BLOCK_M and padding rows. Scratch and output buffers are
poisoned with NaN. On a CUDA device the same checks run at realistic shapes, and once inside a CUDA graph
replayed with other offsets.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.moe import cuda as moe_cuda
from dayzero.ops.moe import reference
from dayzero.ops.moe import triton_moe as T
from dayzero.quant.fp8 import TileScaled, quantize_fp8_blocks
from dayzero.quant.mxfp4 import quantize_mxfp4
from dayzero.quant.workspace import BlockScaled, PackedMXFP4

pytestmark = [pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton"),
              # the interpreter's sigmoid of a very negative gate overflows exp to inf, correctly giving 0
              pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative, of the max-abs and of the norm error
# several tiles per expert at tiny shapes; small row-tile groups, so the program swizzle has a partial last group
SMALL = T.Config(T.KernelConfig(16, 32, 32, group_m=2), T.KernelConfig(16, 16, 32, group_m=3))


@pytest.fixture(autouse=True)
def poisoned(monkeypatch):
    """Scratch h and output y start as NaN: a kernel that reads or leaves unwritten memory fails."""
    monkeypatch.setattr(T, "new_buffer", lambda r, c, like: torch.full((r, c), float("nan"), dtype=like.dtype, device=like.device))


def scaled_randn(*shape, g):
    """Normal weights whose rows and columns have very different magnitudes, so a scale read from the wrong
    block or tile shows."""
    r = lambda *s: torch.randn(*s, generator=g, device=g.device)  # noqa: E731
    return r(*shape) * torch.exp(r(*shape[:-1], 1)) * torch.exp(r(*shape[:-2], 1, shape[-1])) * 0.1


def to_format(w: torch.Tensor, fmt: str, dtype: torch.dtype):
    """Stacked [E, n, k] fp32 weights in the format the kernels read."""
    if fmt == "plain":
        return w.to(dtype)
    if fmt in ("fp8_tile", "fp8_tile_a8"):  # a8: FP8 activations too
        return TileScaled(*quantize_fp8_blocks(w), fp8_activations=fmt == "fp8_tile_a8")
    if fmt == "fp8_block":
        blocks = w.unflatten(-1, (-1, 32))  # [E, n, k/32, 32]
        scale = (blocks.abs().amax(-1) / 448.0).clamp(min=1e-12)
        return BlockScaled((blocks / scale[..., None]).flatten(-2).to(torch.float8_e4m3fn), scale)
    return PackedMXFP4(*quantize_mxfp4(w))


def case(counts, pad, L, I, activation, fmt="plain", dtype=torch.float32, bias=False, seed=0):
    """Rows sorted by expert (``counts`` each, then ``pad`` padding rows) and expert weights, on DEV."""
    g = torch.Generator(DEV).manual_seed(seed)
    E, r = len(counts), 1 if activation == "relu2" else 2
    N = sum(counts) + pad
    xs = torch.randn(N, L, generator=g, device=DEV).to(dtype)
    offsets = torch.tensor(counts, dtype=torch.int64, device=DEV).cumsum(0).to(torch.int32)
    w1 = to_format(scaled_randn(E, r * I, L, g=g), fmt, dtype)
    w2 = to_format(scaled_randn(E, L, I, g=g), fmt, dtype)
    b1, b2 = (torch.randn(E, r * I, generator=g, device=DEV), torch.randn(E, L, generator=g, device=DEV)) if bias else (None, None)
    return xs, offsets, w1, w2, b1, b2


# FP8 activations in bf16: the kernels hold h between the GEMMs in bf16, the reference in fp32, and a rounding to
# bf16 moves about 1 in 32 of the e4m3 roundings after it by a whole e4m3 step (6-12% of that term): on the H200
# 2.8-2.9% of the largest output at most (a misread scale or tile is off by far more)
TOL_A8 = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


def check(out, ref, dtype, rows, tol=TOL):
    """Real rows within the dtype's tolerance of the reference; padding rows zero."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    o, r = out[:rows].float(), ref[:rows].float()
    if rows:
        scale = r.abs().max().clamp(min=1e-6)
        assert (o - r).abs().max() / scale < tol[dtype], f"max-abs error {(o - r).abs().max() / scale:.2e}"
        assert (o - r).norm() / r.norm().clamp(min=1e-6) < tol[dtype]
    assert (out[rows:] == 0).all()


def run(counts, pad, L, I, activation, fmt="plain", dtype=torch.float32, bias=False, limit=None, config=SMALL, seed=0):
    xs, offsets, w1, w2, b1, b2 = case(counts, pad, L, I, activation, fmt, dtype, bias, seed)
    assert T.refusal(xs, offsets, w1, w2, activation, b1, b2, limit) is None
    out = T.moe_experts_grouped(xs, offsets, w1, w2, activation, b1, b2, limit, config=config)
    check(out, reference.grouped_mlp(xs, offsets, w1, w2, activation, b1, b2, limit), dtype, sum(counts),
          TOL_A8 if fmt == "fp8_tile_a8" else TOL)


ACTS = [("silu", False, None), ("silu", True, None), ("silu", False, 0.7), ("relu2", True, None),
        ("swiglu_oai", True, None), ("swiglu_oai", False, None)]
SHAPES = {  # counts per expert (empty experts, counts not multiples of 16), padding rows, L, I
    "E4-L48-I32": ([10, 0, 17, 7], 3, 48, 32),
    "E6-L32-I64": ([1, 0, 0, 33, 0, 2], 0, 32, 64),
}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation,bias,limit", ACTS, ids=lambda v: str(v))
def test_plain_fp32_matches_reference(shape, activation, bias, limit):
    counts, pad, L, I = SHAPES[shape]
    run(counts, pad, L, I, activation, bias=bias, limit=limit)


@pytest.mark.parametrize("activation", ["silu", "relu2", "swiglu_oai"])
def test_plain_bf16_matches_reference(activation):
    run([10, 0, 17, 7], 3, 48, 32, activation, dtype=torch.bfloat16, bias=True, limit=0.7 if activation == "silu" else None)


@pytest.mark.parametrize("fmt,dtype", [("plain", torch.float32), ("plain", torch.bfloat16), ("mxfp4", torch.bfloat16)])
def test_tokens_read_through_the_pair_order_equal_the_gathered_rows(fmt, dtype):
    """With ``order`` the first kernel reads each sorted row from its token (order[r] // top_k): the same output,
    bit for bit, as the kernels over the gathered rows, and the reference's within tolerance."""
    g = torch.Generator(DEV).manual_seed(7)
    T_, k, E, L, I = 13, 3, 5, 64, 32
    ids = torch.rand(T_, E, generator=g, device=DEV).topk(k, dim=-1).indices
    order, offsets = reference.permute(ids, E)
    x = torch.randn(T_, L, generator=g, device=DEV).to(dtype)
    w1 = to_format(scaled_randn(E, 2 * I, L, g=g), fmt, dtype)
    w2 = to_format(scaled_randn(E, L, I, g=g), fmt, dtype)
    assert T.refusal(x, offsets, w1, w2, order=order) is None
    got = T.moe_experts_grouped(x, offsets, w1, w2, config=SMALL, order=order, top_k=k)
    rows = x[order // k]
    assert torch.equal(got, T.moe_experts_grouped(rows, offsets, w1, w2, config=SMALL))
    want = reference.grouped_mlp(x, offsets, w1, w2, order=order, top_k=k)
    check(got, want, dtype, T_ * k)
    assert torch.equal(want, reference.grouped_mlp(rows, offsets, w1, w2))
    # the cuda op takes the same path, and its fallbacks gather first
    torch.testing.assert_close(moe_cuda.grouped_mlp(x, offsets, w1, w2, order=order, top_k=k), got)


@pytest.mark.parametrize("fmt,L,I", [("fp8_tile", 160, 96), ("fp8_block", 64, 32), ("mxfp4", 64, 32),
                                     ("fp8_tile_a8", 160, 96)])
@pytest.mark.parametrize("activation,bias,limit", [("silu", False, None), ("relu2", True, None), ("swiglu_oai", True, None)],
                         ids=lambda v: str(v))
def test_quantised_weights_match_reference(fmt, L, I, activation, bias, limit):
    """Reference and kernels see the same quantised weights: only the dequantisation in the K loop is tested.
    fp8_tile at L=160, I=96 crosses 128-tile boundaries along both n (gate/up rows) and k; with FP8 activations
    the last K step's quantisation group is a partial one (160 = 128 + 32, 96 < 128)."""
    run([5, 0, 19], 2, L, I, activation, fmt, bias=bias, limit=limit)


@pytest.mark.parametrize("fmt", ["fp8_tile", "fp8_block", "mxfp4", "fp8_tile_a8"])
def test_quantised_weights_bf16(fmt):
    run([3, 18, 0, 1], 1, 64, 64, "silu", fmt, dtype=torch.bfloat16, config=None)


@pytest.mark.parametrize("config", [
    T.Config(T.KernelConfig(16, 16, 16), T.KernelConfig(32, 64, 16)),
    T.Config(T.KernelConfig(64, 64, 128), T.KernelConfig(16, 32, 64)),
    None,  # the default heuristic
], ids=["small", "large", "default"])
def test_block_sizes(config):
    run([40, 1, 0, 16, 15], 5, 48, 32, "silu", bias=True, config=config)


def test_program_swizzle_with_real_tiles_in_a_partial_last_group():
    # one row per expert: 7 row-tile bounds, 6 real; groups of 4 -> the last group (tiles 4..6) is partial and
    # holds real tiles, each across 4 column tiles
    c = T.KernelConfig(16, 16, 32, group_m=4)
    run([1] * 6, 0, 64, 64, "silu", bias=True, config=T.Config(c, c))


@pytest.mark.parametrize("rows,pad", [(0, 0), (0, 4), (1, 0)])
def test_no_rows_one_row_and_only_padding(rows, pad):
    run([0, rows, 0], pad, 32, 32, "silu", bias=True)


def test_mxfp4_nan_scale_gives_nan_like_the_reference():
    xs, offsets, w1, w2, _, _ = case([3, 4], 0, 32, 32, "silu", "mxfp4")
    w1.scales[0, 0, 0] = 0xFF  # E8M0 NaN: one block of expert 0's first gate row
    out = T.moe_experts_grouped(xs, offsets, w1, w2, config=SMALL)
    ref = reference.grouped_mlp(xs, offsets, w1, w2)
    assert out[:3].isnan().all() and ref[:3].isnan().all()
    check(out[3:], ref[3:], torch.float32, 4)


def test_cuda_op_takes_the_triton_path():
    xs, offsets, w1, w2, b1, b2 = case([4, 0, 9], 2, 32, 32, "swiglu_oai", "mxfp4", bias=True)
    assert moe_cuda._verify(xs, offsets, w1, w2) is None
    out = moe_cuda.grouped_mlp(xs, offsets, w1, w2, "swiglu_oai", b1, b2)
    check(out, reference.grouped_mlp(xs, offsets, w1, w2, "swiglu_oai", b1, b2), torch.float32, 13)


def test_packed_mxfp4_indexes_like_the_dequantised_tensor():
    w = scaled_randn(3, 8, 64, g=torch.Generator().manual_seed(1)).to(DEV)  # the same draw on every device
    packed = PackedMXFP4(*quantize_mxfp4(w))
    assert tuple(packed.shape) == (3, 8, 64)
    assert torch.equal(packed[1], packed.float()[1]) and (packed[1] - w[1]).abs().max() < 0.2 * w[1].abs().max()


def test_refusal_names_the_reason(monkeypatch):
    xs, offsets, w1, w2, b1, b2 = case([4, 3], 0, 32, 32, "silu")
    assert T.refusal(xs, offsets, w1, w2) is None
    assert "int32" in T.refusal(xs, offsets.float(), w1, w2)
    assert "int8" in T.refusal(xs, offsets, w1.to(torch.int8), w2)
    assert "no weight format" in T.refusal(xs, offsets, object(), w2)
    assert "expected" in T.refusal(xs, offsets, w1[:, :, :16], w2)
    assert "activation" in T.refusal(xs, offsets, w1, w2, "gelu")
    assert "b2" in T.refusal(xs, offsets, w1, w2, b2=torch.zeros(2, 7, device=xs.device))
    monkeypatch.setattr(triton_support, "HAS_TRITON", False)
    assert "not installed" in T.refusal(xs, offsets, w1, w2)
    monkeypatch.setattr(triton_support, "HAS_TRITON", True)
    if xs.device.type == "cpu":
        monkeypatch.setattr(triton_support, "INTERPRET", False)
        assert "not on cpu" in T.refusal(xs, offsets, w1, w2)
    else:  # the FP8 paths run on GPUs too
        assert T.refusal(xs, offsets, to_format(w1.float(), "fp8_block", xs.dtype), w2) is None


def test_cuda_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import dayzero.ops.moe.cuda as c, torch\n"
            "print(c.triton_moe.refusal(torch.zeros(1, 32), torch.zeros(1, dtype=torch.int32), torch.zeros(1, 64, 32), "
            "torch.zeros(1, 32, 32)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "triton is not installed" in out


# ---------------------------------------------------------------- on a CUDA device, realistic shapes

def uniform_counts(N: int, E: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.randint(0, E, (N,), generator=g), minlength=E).tolist()


@cuda
@pytest.mark.parametrize("fmt", ["plain", "fp8_tile", "fp8_block", "mxfp4", "fp8_tile_a8"])
@pytest.mark.parametrize("N", [1, 37, 512, 4096])
def test_gpu_realistic_shapes(fmt, N):
    counts = uniform_counts(N, 64, seed=N)
    run(counts, 8, 2048, 512, "silu", fmt, dtype=torch.bfloat16, bias=fmt == "plain", config=None)


@cuda
def test_gpu_graph_replay_with_other_offsets():
    E, L, I, N = 64, 2048, 512, 1024
    xs, offsets, w1, w2, _, _ = case(uniform_counts(N - 16, E, 0), 16, L, I, "silu", "mxfp4", torch.bfloat16)
    out = T.moe_experts_grouped(xs, offsets, w1, w2)  # compiles before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = T.moe_experts_grouped(xs, offsets, w1, w2)
    for seed, pad in ((1, 16), (2, 300)):
        offsets.copy_(torch.tensor(uniform_counts(N - pad, E, seed), device=DEV).cumsum(0))
        xs.copy_(torch.randn_like(xs))
        graph.replay()
        torch.cuda.synchronize()
        check(out, reference.grouped_mlp(xs, offsets, w1, w2), torch.bfloat16, N - pad)


def test_kernels_compile_for_hopper_without_a_gpu():
    """Front end, layouts and ptxas for sm90 (the bundled toolchain): catches what the interpreter cannot."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.ops.moe_triton_aot"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("R,K_", [(1, 64), (37, 160), (64, 256), (0, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantiser_rounds_like_the_reference(R, K_, dtype):
    """The codes and scales the GEMMs with FP8 activations read, against ``quantize_activations``: a partial last
    group (160 = 128 + 32), rows past a block of 32, a row of zeros, a strided input."""
    from dayzero.quant.fp8 import quantize_activations

    g = torch.Generator(DEV).manual_seed(3)
    wide = (torch.randn(R, 2 * K_, generator=g, device=DEV) * torch.exp(torch.randn(R, 1, generator=g, device=DEV)))
    x = wide[:, ::2].to(dtype)  # every other column: a column stride of 2
    if R > 1:
        x[1] = 0
    q, s = T.quantize_groups(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (R, K_) and s.shape == (R, -(-K_ // 128))
    got = (q.float().unflatten(-1, (-1, 128)) if K_ % 128 == 0 else
           torch.nn.functional.pad(q.float(), (0, -K_ % 128)).unflatten(-1, (-1, 128))) * s[..., None]
    want = quantize_activations(x.float())
    assert torch.equal(got.flatten(-2)[:, :K_], want)
