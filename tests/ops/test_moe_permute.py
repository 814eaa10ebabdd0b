"""The routed experts as separate ops (permute -> grouped MLP -> unpermute) against a per-token loop, and the
sync-free CUDA paths run as plain functions on CPU tensors against the reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dayzero import ops
from dayzero.config.model_config import HybridConfig
from dayzero.layers.moe import MoE
from dayzero.models.init import init_random_weights
from dayzero.ops import registry
from dayzero.ops.moe import cuda as moe_cuda
from dayzero.ops.moe.reference import grouped_experts, grouped_mlp, permute, unpermute
from dayzero.quant.fp8 import TileScaled, quantize_fp8_blocks
from dayzero.quant.workspace import BlockScaled
from tests.conftest import tiny_config

# max relative error (max|out - ref| / max|ref|) allowed, per output dtype
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_close_rel(out, ref, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    assert out.shape == ref.shape and out.dtype == dtype
    if ref.numel() == 0:
        return
    assert not torch.isnan(out).any()
    err = (out.double() - ref.double()).abs()
    scale = ref.double().abs().max().clamp_min(1e-30)
    assert err.max() / scale <= tol, f"max rel err {float(err.max() / scale):.3g}"
    torch.testing.assert_close(out.double(), ref.double(), rtol=10 * tol, atol=tol * float(scale))


def routing(T, E, k, seed, used_every=2):
    """ids [T, k] over every ``used_every``-th expert only (so the others have no rows), weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    used = torch.arange(0, E, used_every)
    ids = torch.stack([used[torch.randint(len(used), (k,), generator=g)] for _ in range(T)]) if T else \
        torch.zeros(0, k, dtype=torch.long)  # repeats allowed: one expert in two slots of a token
    return ids, torch.rand(T, k, generator=g) + 0.1


# ---------------------------------------------------------------- permute

PERMUTE_CASES = [(0, 4, 2), (1, 8, 3), (1, 1, 1), (13, 16, 4), (37, 9, 3), (64, 5, 1)]  # (T, E, k)


@pytest.mark.parametrize("T,E,k", PERMUTE_CASES, ids=[f"T{T}-E{E}-k{k}" for T, E, k in PERMUTE_CASES])
def test_permute_is_a_stable_sort_with_row_ends(T, E, k):
    ids, _ = routing(T, E, k, seed=T * E + k)
    order, offsets = ops.call("moe_permute", ids, E)
    assert order.dtype == torch.int64 and order.shape == (T * k,)
    assert offsets.dtype == torch.int32 and offsets.shape == (E,)
    flat = ids.flatten().tolist()
    # the one stable sort by expert, written out: pairs in order of (expert, flat index)
    assert order.tolist() == sorted(range(T * k), key=lambda p: (flat[p], p))
    counts = [flat.count(e) for e in range(E)]
    assert offsets.tolist() == [sum(counts[:e + 1]) for e in range(E)]
    if T > 1 and E > 1:
        assert 0 in counts  # experts without rows are in the case


def test_permute_rejects_flat_ids():
    with pytest.raises(ValueError, match=r"\[T, k\]"):
        permute(torch.zeros(4, dtype=torch.long), 2)


def test_unpermute_weights_each_pair():
    # 2 tokens, k=2; rows in expert order name their pairs through ``order``
    ys = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0], [1000.0, 2000.0]])
    order = torch.tensor([3, 0, 2, 1])  # row 0 is pair (1, 1), row 1 is (0, 0), ...
    weights = torch.tensor([[0.5, 2.0], [0.25, 1.0]])
    out = unpermute(ys, order, weights, 2)
    torch.testing.assert_close(out, torch.tensor([[0.5 * 10 + 2.0 * 1000, 0.5 * 20 + 2.0 * 2000],
                                                  [0.25 * 100 + 1.0 * 1, 0.25 * 200 + 1.0 * 2]]))
    with pytest.raises(ValueError, match="weights"):
        unpermute(ys, order, weights, 3)


# ---------------------------------------------------------------- permute -> grouped MLP -> unpermute

def act_loop(h, activation, limit):
    """The activation on one pre-activation vector, in float64, written out (rows [gate; up] when gated)."""
    if activation == "relu2":
        return torch.relu(h) ** 2
    g, u = h.chunk(2)
    if activation == "swiglu_oai":
        g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
        return g * torch.sigmoid(1.702 * g) * (u + 1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return F.silu(g) * u


def loop_experts(x, ids, weights, w1, w2, activation, b1=None, b2=None, limit=None):
    """Per token, per chosen expert, in float64: the definition of the routed MoE sum."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w1[e].double() @ x[t].double() + (0 if b1 is None else b1[e].double())
            out = w2[e].double() @ act_loop(h, activation, limit) + (0 if b2 is None else b2[e].double())
            y[t] += float(weights[t, j]) * out
    return y


def make_weights(E, D, inter, activation, bias, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = inter if activation == "relu2" else 2 * inter
    w1 = 3 * torch.randn(E, rows, D, generator=g) / D**0.5  # large enough that pre-activations pass ±limit
    w2 = torch.randn(E, D, inter, generator=g) / inter**0.5
    b1, b2 = (torch.randn(E, rows, generator=g), torch.randn(E, D, generator=g)) if bias else (None, None)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    return cast(w1), cast(w2), cast(b1), cast(b2)


ACTIVATIONS = [("silu", None), ("silu", 0.5), ("relu2", None), ("swiglu_oai", None)]
PIPE_CASES = [(13, 16, 4, 24, 40), (37, 9, 3, 11, 5), (1, 8, 2, 16, 12), (0, 4, 2, 8, 6)]  # (T, E, k, D, I)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("activation,limit", ACTIVATIONS, ids=["silu", "silu-clamp", "relu2", "swiglu_oai"])
@pytest.mark.parametrize("T,E,k,D,inter", PIPE_CASES, ids=[f"T{T}-E{E}-k{k}-D{D}-I{i}" for T, E, k, D, i in PIPE_CASES])
def test_pipeline_matches_loop_and_grouped_experts(T, E, k, D, inter, activation, limit, bias):
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    ids, weights = routing(T, E, k, seed=T + E)
    w1, w2, b1, b2 = make_weights(E, D, inter, activation, bias, seed=E)
    order, offsets = ops.call("moe_permute", ids, E)
    ys = ops.call("moe_experts_grouped", x[order // k], offsets, w1, w2, activation, b1, b2, limit)
    out = ops.call("moe_unpermute", ys, order, weights, T)
    assert_close_rel(out, loop_experts(x, ids, weights, w1, w2, activation, b1, b2, limit), torch.float32)
    torch.testing.assert_close(out, grouped_experts(x, ids, weights, w1, w2, activation, b1, b2, limit))


def test_grouped_mlp_validates_offsets():
    w1, w2, _, _ = make_weights(3, 8, 6, "silu", False, seed=0)
    xs = torch.randn(5, 8)
    with pytest.raises(ValueError, match="non-decreasing"):
        grouped_mlp(xs, torch.tensor([2, 1, 5], dtype=torch.int32), w1, w2)
    with pytest.raises(ValueError, match="offsets"):
        grouped_mlp(xs, torch.tensor([2, 5], dtype=torch.int32), w1, w2)


# ---------------------------------------------------------------- the CUDA paths, on CPU tensors

def fp8_experts(kind, E, rows, cols, seed):
    """(container, its dequantised fp32 weight [E, rows, cols]) for TileScaled or BlockScaled storage."""
    w = torch.randn(E, rows, cols, generator=torch.Generator().manual_seed(seed)) / cols**0.5
    if kind in ("tile", "tile-a8"):  # a8: the products take FP8-rounded activations
        w8, scale_inv = quantize_fp8_blocks(w)  # [E, rows, cols], [E, ceil(rows/128), ceil(cols/128)]
        c = TileScaled(w8, scale_inv, fp8_activations=kind == "tile-a8")
    else:  # 32-element blocks with power-of-two scales, as the FP8 workspace holds them
        scale = torch.exp2(torch.randint(-3, 3, (E, rows, cols // 32), generator=torch.Generator().manual_seed(seed)).float())
        c = BlockScaled((w * 4).to(torch.float8_e4m3fn), scale)
    return c, torch.stack([c[e] for e in range(E)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weights_kind", ["fp32", "tile", "block", "tile-a8"])
@pytest.mark.parametrize("activation,limit", ACTIVATIONS, ids=["silu", "silu-clamp", "relu2", "swiglu_oai"])
def test_masked_fallback_equals_reference(weights_kind, activation, limit, dtype):
    E, k, T, D, inter = 6, 2, 19, 64, 32  # fp8 blocks need widths of whole 32-blocks
    ids, weights = routing(T, E, k, seed=7)
    rows = inter if activation == "relu2" else 2 * inter
    if weights_kind == "fp32":
        w1, w2, b1, b2 = make_weights(E, D, inter, activation, True, seed=8)
    else:
        (w1, _), (w2, _) = fp8_experts(weights_kind, E, rows, D, 9), fp8_experts(weights_kind, E, D, inter, 10)
        b1, b2 = None, None
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(11)).to(dtype)
    order, offsets = permute(ids, E)
    xs = torch.cat([x[order // k], torch.randn(3, D).to(dtype)])  # 3 rows of padding past offsets[-1]
    got = moe_cuda.masked_grouped_mlp(xs, offsets, w1, w2, activation, b1, b2, limit)
    ref = grouped_mlp(xs, offsets, w1, w2, activation, b1, b2, limit)
    assert_close_rel(got, ref, dtype)
    assert not got[-3:].any()  # padding rows belong to no expert
    # the CUDA op runs the Triton expert kernels here (through the interpreter), which round h to bf16
    assert_close_rel(moe_cuda.grouped_experts(x, ids, weights, w1, w2, activation, b1, b2, limit),
                     grouped_experts(x, ids, weights, w1, w2, activation, b1, b2, limit), dtype,
                     3e-2 if dtype == torch.bfloat16 else None)


def test_expert_of_rows():
    offsets = torch.tensor([0, 3, 3, 7, 8], dtype=torch.int32)  # experts 0 and 2 have no rows
    assert moe_cuda.expert_of_rows(offsets, 10).tolist() == [1, 1, 1, 3, 3, 3, 3, 4, 5, 5]


def _cpu_grouped_mm_works() -> bool:
    try:
        F.grouped_mm(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(1, 8, 8, dtype=torch.bfloat16),
                     offs=torch.tensor([2], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not _cpu_grouped_mm_works(), reason="this torch has no CPU grouped_mm")
@pytest.mark.parametrize("activation,limit,bias", [("silu", None, False), ("silu", 0.5, False), ("relu2", None, False),
                                                   ("swiglu_oai", None, True)])
def test_grouped_mm_path_equals_reference(activation, limit, bias):
    E, k, T, D, inter = 8, 2, 29, 64, 48
    ids, weights = routing(T, E, k, seed=3, used_every=1)
    w1, w2, b1, b2 = make_weights(E, D, inter, activation, bias, seed=4, dtype=torch.bfloat16)
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    order, offsets = permute(ids, E)
    got = moe_cuda.grouped_mm_mlp(x[order // k], offsets, w1, w2, activation, b1, b2, limit)
    ref = grouped_mlp(x[order // k], offsets, w1, w2, activation, b1, b2, limit).float()
    rel = ((got.float() - ref).norm() / ref.norm()).item()
    assert got.dtype == torch.bfloat16 and rel < 1e-2, rel  # bf16 rounding of the output and of act(h)


# ---------------------------------------------------------------- nothing reads device data on the host

# aten ops that read a tensor's values on the host (a device sync on CUDA), or build a tensor from host data
HOST_READS = ("_local_scalar_dense", "nonzero", "bincount", "unique", "masked_select", "lift_fresh", "equal",
              "is_nonzero", "repeat_interleave.Tensor", "argwhere")


class HostReads(TorchDispatchMode):
    """Records every aten op that would wait on the device, including indexing with a boolean mask, and
    ``Tensor.tolist`` (which reads the data without an aten op)."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: self.found.append("tolist") or self._tolist(t)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        masks = func.__name__.startswith("index") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for a in args if isinstance(a, (list, tuple)) for i in a)
        if masks or any(r in name for r in HOST_READS):
            self.found.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("weights_kind", ["fp32", "tile", "block"])
def test_sync_free_paths_read_nothing_on_the_host(weights_kind):
    E, k, T, D, inter = 6, 2, 9, 64, 32
    ids, weights = routing(T, E, k, seed=1)
    if weights_kind == "fp32":
        w1, w2, b1, b2 = make_weights(E, D, inter, "silu", True, seed=2)
    else:
        (w1, _), (w2, _) = fp8_experts(weights_kind, E, 2 * inter, D, 3), fp8_experts(weights_kind, E, D, inter, 4)
        b1, b2 = None, None
    x = torch.randn(T, D)
    with HostReads() as mode:
        moe_cuda.grouped_experts(x, ids, weights, w1, w2, "silu", b1, b2)
    assert mode.found == []
    with HostReads() as mode:  # the check works: the reference checks the ids and loops over the offsets
        grouped_experts(x, ids, weights, w1, w2, "silu", b1, b2)
    assert "aten._local_scalar_dense.default" in mode.found and "tolist" in mode.found


def test_moe_layer_reads_nothing_on_the_host_with_the_cuda_expert_op():
    m = HybridConfig.from_dict(tiny_config()).to_spec()
    moe = init_random_weights(MoE(m.hidden_size, m.layers[-1].mlp).float(), seed=3, std=0.2)
    x = torch.randn(7, m.hidden_size)
    # their sync-free paths run on CPU tensors too: the whole op (inference) and the sorted one's expert part
    for op in ("moe_experts", "moe_experts_grouped"):
        registry.override(op, "cuda")
    try:
        with torch.no_grad(), HostReads() as mode:
            got = moe(x)
        with HostReads() as sorted_mode:  # with gradients the layer runs the split ops
            moe(x)
    finally:
        for op in ("moe_experts", "moe_experts_grouped"):
            registry.override(op, None)
    assert mode.found == [] and sorted_mode.found == []
    with torch.no_grad():
        assert_close_rel(got, moe(x), torch.float32)  # the reference expert op
