"""The per-head product kernel (MLA's absorbed query and output on decode rows) against an fp32 einsum of the same
operands: on the CPU through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), at
odd sizes and block boundaries, both weight layouts (reduction or outputs contiguous), as views of one
``kv_b_proj``-like weight as MLA reads it; on a GPU also replayed from a CUDA graph behind another kernel
(programmatic dependent launch, the weight read before the wait)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from dayzero.ops.attention import head_kernels as HK  # noqa: E402
from dayzero.ops.attention import triton_mla  # noqa: E402
from dayzero.ops.static import mark_static  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.einsum("thi,hij->thj", x.double(), w.double())


def kv_b(heads: int, n: int, v: int, r: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A kv_b_proj weight [H * (N + V), R] viewed as MLA views it: per head N rows of W_UK then V rows of W_UV."""
    w = torch.randn(heads * (n + v), r, generator=gen) / r ** 0.5
    return mark_static(w.to(dtype).to(DEV))


def check(x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor | None = None) -> None:
    assert HK.refusal(x, w) is None
    y = HK.head_product(x, w, weight)
    assert y.shape == (x.shape[0], x.shape[1], w.shape[2]) and y.dtype == x.dtype
    want = reference(x, w)
    err = (y.double() - want).abs().max().item()
    assert err <= TOL[x.dtype] * max(1.0, want.abs().max().item()), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,heads,n,v,r", [(1, 2, 16, 16, 64), (3, 3, 24, 8, 40), (8, 2, 16, 12, 32),
                                              (5, 1, 130, 17, 20)])
def test_mla_absorb_and_output_views(rows, heads, n, v, r, dtype):
    gen = torch.Generator().manual_seed(rows * 100 + heads)
    weight = kv_b(heads, n, v, r, dtype, gen)
    w = weight.view(heads, n + v, r)
    q_nope = torch.randn(rows, heads, n, generator=gen).to(dtype).to(DEV)
    check(q_nope, w[:, :n], weight)  # q~ = q_nope W_UK: the reduction over strided rows, outputs contiguous
    o_lat = torch.randn(rows, heads, r, generator=gen).to(dtype).to(DEV)
    check(o_lat, w[:, n:].transpose(1, 2), weight)  # o = o_lat W_UVᵀ: the reduction contiguous


def partials(rows, heads, splits, r, sinks, dtype, gen) -> HK.Partials:
    """Split-kernel output as MLA's product takes it: random sums, maxima (log2 units) with one split of each
    (row, head) left without a key (max -inf, sum 0), positive sums of weights."""
    o = torch.randn(rows, heads, splits, r, generator=gen)
    m = torch.randn(rows, heads, splits, generator=gen) * 4
    m[:, :, splits // 2] = float("-inf")
    ml = torch.stack([m, torch.rand(rows, heads, splits, generator=gen) * 3 + 0.1], -1)
    ml[:, :, splits // 2, 1] = 0.0
    o[:, :, splits // 2] = 0.0
    s = torch.randn(heads, generator=gen).to(DEV) if sinks else None
    return HK.Partials(o.to(DEV), ml.to(DEV), s, torch.empty(rows, heads, r, dtype=dtype, device=DEV))


def merged_reference(p: HK.Partials) -> torch.Tensor:
    """o_lat [T, H, R] from the partials in float64: each split's sum scaled by 2^(its max - the common max), over
    the splits' scaled sums plus the sink's e^sink."""
    o, m_s, l_s = p.o.double(), p.ml[..., 0].double(), p.ml[..., 1].double()
    m = m_s.amax(-1)
    if p.sinks is not None:
        sink = p.sinks.double()[None, :] * 1.4426950408889634
        m = torch.maximum(m, sink)
    w = torch.exp2(m_s - m[..., None])
    denom = (l_s * w).sum(-1) + (torch.exp2(sink - m) if p.sinks is not None else 0.0)
    return (o * w[..., None]).sum(2) / denom[..., None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("rows,heads,splits,v,r", [(1, 3, 3, 8, 40), (3, 2, 5, 12, 24), (4, 16, 18, 16, 64)])
def test_merged_product_merges_the_splits_as_it_reads_them(rows, heads, splits, v, r, sinks, dtype):
    """MLA's output product over o_lat given as split partials equals the merge kernel followed by the product, and
    the float64 merge then product."""
    gen = torch.Generator().manual_seed(rows * 10 + splits)
    weight = kv_b(heads, 8, v, r, dtype, gen)
    w = weight.view(heads, 8 + v, r)[:, 8:].transpose(1, 2)  # W_UV: the reduction contiguous
    p = partials(rows, heads, splits, r, sinks, dtype, gen)
    y = HK.merged_head_product(p, w, weight)
    assert y.shape == (rows, heads, v) and y.dtype == dtype
    o_lat = triton_mla.merge_partials(p)
    close = TOL[dtype] * max(1.0, y.abs().max().item())
    assert (y.double() - HK.head_product(o_lat, w, weight).double()).abs().max().item() <= close
    want = reference(merged_reference(p).to(dtype), w)
    assert (y.double() - want).abs().max().item() <= close


@pytest.mark.parametrize("rows,heads,n,v,r", [(1, 2, 16, 16, 64), (3, 3, 24, 8, 40), (5, 1, 130, 17, 20)])
def test_rows_read_early_give_the_same_product(rows, heads, n, v, r):
    """``early``: the first weight step's product before the wait (at these shapes one step, or two for 130 rows of
    W_UK): the same values as after it."""
    gen = torch.Generator().manual_seed(rows + heads)
    weight = kv_b(heads, n, v, r, torch.bfloat16, gen)
    w = weight.view(heads, n + v, r)
    q = torch.randn(rows, heads, n, generator=gen).to(torch.bfloat16).to(DEV)
    assert torch.equal(HK.head_product(q, w[:, :n], weight, early=True), HK.head_product(q, w[:, :n], weight))
    check(q, w[:, :n], weight)


def test_strided_rows_and_small_blocks():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 2 * 33, generator=gen).to(DEV)[:, :, :33]  # rows and heads strided, unit channel stride
    w = torch.randn(4, 33, 5, generator=gen).to(DEV)  # 5 outputs: a block of 4 columns and a partial one
    check(x, w)
    assert HK.blocks(2, 4, 33, 5, programs=8)[1] == 4


def test_blocks_fill_the_device_and_bound_the_tile():
    # dayzero-small: 16 heads, W_UK [128, 512] and W_UV [512 -> 128], ~256 programs, the whole slice in one tile
    assert HK.blocks(1, 16, 128, 512) == (128, 32)
    assert HK.blocks(1, 16, 512, 128) == (512, 8)
    for rows in (1, 2, 3, 8):  # the rows go through the tile in turn: the tile does not shrink with them
        assert HK.blocks(rows, 16, 512, 128) == (512, 8)
    assert HK.blocks(1, 16, 1024, 128) == (512, 8)  # a reduction past the tile: two steps


def test_refusals_name_the_reason():
    x = torch.randn(2, 3, 8, device=DEV)
    w = torch.randn(3, 8, 4, device=DEV)
    assert "rows" in HK.refusal(torch.randn(HK.MAX_ROWS + 1, 3, 8, device=DEV), w)
    assert "rows" in HK.refusal(x[:0], w)
    assert "heads" in HK.refusal(x, torch.randn(2, 8, 4, device=DEV))
    assert "dtype" in HK.refusal(x.to(torch.bfloat16), w)
    assert "unit stride" in HK.refusal(x, torch.randn(3, 8 * 2, 4 * 2, device=DEV)[:, ::2, ::2])
    assert "unit stride" in HK.refusal(torch.randn(2, 3, 16, device=DEV)[:, :, ::2], w)


def test_weight_read_early_only_when_static(monkeypatch):
    """The weight's tile is read before the wait only for a model weight (a tensor a step's kernels never write)."""
    seen = []
    real = HK.preload

    def spy(t, weight):
        out = real(t, weight)
        seen.append(out["PRELOAD"])
        return out

    monkeypatch.delenv("DAYZERO_WEIGHT_PRELOAD", raising=False)
    monkeypatch.setattr(HK, "preload", spy)
    gen = torch.Generator().manual_seed(5)
    weight = kv_b(2, 16, 16, 32, torch.float32, gen)
    x = torch.randn(1, 2, 16, generator=gen).to(DEV)
    HK.head_product(x, weight.view(2, 32, 32)[:, :16], weight)
    HK.head_product(x, weight.view(2, 32, 32)[:, :16].clone())
    assert seen == [True, False]


@gpu
def test_gpu_real_shapes_in_a_graph_behind_another_kernel():
    gen = torch.Generator().manual_seed(7)
    H, N, V, R = 16, 128, 128, 512
    weight = kv_b(H, N, V, R, torch.bfloat16, gen)
    w = weight.view(H, N + V, R)
    for rows in (1, 4, 8):
        q = torch.randn(rows, H, N, generator=gen).to(torch.bfloat16).cuda()
        src = torch.randn(rows, H, N, generator=gen).to(torch.bfloat16).cuda()
        graph = torch.cuda.CUDAGraph()
        HK.head_product(q, w[:, :N], weight)  # compile outside the capture
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            with torch.cuda.graph(graph, stream=side):
                q.copy_(src * 2)  # the kernel before: writes the product's input
                y = HK.head_product(q, w[:, :N], weight)
                o = HK.head_product(y, w[:, N:].transpose(1, 2), weight)
                y_early = HK.head_product(q, w[:, :N], weight, early=True)  # q written three launches back
        torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y_early, y)
        want = reference(src * 2, w[:, :N])
        assert (y.double() - want).abs().max().item() <= 1e-2 * want.abs().max().item()
        want_o = reference(y, w[:, N:].transpose(1, 2))
        assert (o.double() - want_o).abs().max().item() <= 1e-2 * want_o.abs().max().item()
