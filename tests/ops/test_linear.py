"""The skinny linear kernel (1-8 rows, up to 64 on the tensor cores) against the fp64 product, at every block
shape it may be given, odd sizes and mixed dtypes (the router's bf16 tokens against fp32 weights, fp32 out); the
reference op's dtype rule; the refusals; on a CUDA device the measured choice, the op inside a CUDA graph, and
the layers that call it.

On the CPU the kernel runs through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""
from __future__ import annotations

import pytest
import torch

from dayzero import ops
from dayzero.ops.linear import act as AL, kernels as L, norm as NL
from dayzero.ops.linear.reference import (act_linear as reference_act, dual_linear as reference_dual,
                                          linear as reference, rms_norm_gated_linear as reference_gated,
                                          rms_norm_linear as reference_norm, sigmoid_gate_linear as reference_gate)
from dayzero.ops import triton_support
from dayzero.ops.static import is_static, mark_static, preload

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def operands(M, N, K, x_dtype, w_dtype, bias, seed=0):
    g = torch.Generator(DEV).manual_seed(seed)
    x = torch.randn(M, K, generator=g, device=DEV).to(x_dtype)
    w = mark_static((torch.randn(N, K, generator=g, device=DEV) / K ** 0.5).to(w_dtype))  # read before the wait
    b = torch.randn(N, generator=g, device=DEV).to(w_dtype) if bias else None
    return x, w, b


def exact(x, w, b):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def close(got, want, dtype):
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err < TOL[dtype], f"max error {err:.2e} of the largest output"


@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (3, 64, 256), (8, 24, 48), (5, 130, 33)], ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_every_candidate_block_matches_fp64(M, N, K, bias):
    x, w, b = operands(M, N, K, torch.float32, torch.float32, bias)
    for block in L.candidates(M, N, K) + [(4, 16, 4), (16, 64, 4)]:  # short K steps: several steps, a ragged last
        got = L.skinny_linear(x, w, b, block=block)
        assert got.shape == (M, N) and got.dtype == torch.float32
        close(got, exact(x, w, b), torch.float32)


@pytest.mark.parametrize("M,N,K,block", [(1, 37, 100, (4, 32, 4)), (3, 64, 256, (8, 256, 4)), (5, 40, 96, (16, 32, 4, 2)),
                                         (2, 24, 33, (16, 16, 4, 2))], ids=str)
def test_the_weight_read_before_the_wait_changes_no_value(M, N, K, block):
    """PRELOAD peels the first K step off the loop (its weight tile read before the wait): every prologue and
    epilogue gives the same bits as the loop whole."""
    dtype = torch.bfloat16 if len(block) > 3 else torch.float32
    x, w, b = operands(M, N, K, dtype, dtype, True)
    g = torch.Generator(DEV).manual_seed(2)
    r = torch.randn(M, K, generator=g, device=DEV).to(dtype)
    gw = (1 + 0.1 * torch.randn(K, generator=g, device=DEV)).float()
    x2, w2, _ = operands(M, N, 48, dtype, dtype, False, seed=3)
    add = torch.randn(M, N, generator=g, device=DEV).to(dtype)
    cases = {"plain": {"bias": b, "add": add}, "act": {"activation": "silu"},
             "second": {"second": (torch.cat([x2, x2], 1), w2), "activation": "silu"}}
    for what, kw in cases.items():
        xs = torch.cat([x, x], 1) if what == "act" else x
        outs = []
        for early in (False, True):
            y = torch.empty(M, N, dtype=dtype, device=DEV)
            L.launch(xs, w, y, K, block, early=early, **kw)
            outs.append(y)
        assert torch.equal(*outs), what
    outs = []
    for early in (False, True):
        y, n, s = torch.empty(M, N, dtype=dtype, device=DEV), torch.empty_like(x), torch.empty_like(x)
        L.launch(x, w, y, K, block, eps=1e-6, norm=(gw, r, n, s), early=early)
        outs.append((y, n, s))
    assert all(torch.equal(a, c) for a, c in zip(*outs)), "norm"


def test_weights_read_early_are_parameters_and_marked_ones_only(monkeypatch):
    x = torch.zeros(1, 4, device=DEV)
    plain = torch.zeros(2, 4, device=DEV)
    param = torch.nn.Parameter(torch.zeros(2, 4, device=DEV), requires_grad=False)
    assert not preload(x, plain)["PRELOAD"]
    assert preload(x, param)["PRELOAD"]
    assert preload(x, mark_static(plain))["PRELOAD"] and is_static(plain)
    assert not is_static(plain[:1])  # a view may be of anything
    copies = L.cold_copies(param, total=64)
    assert len(copies) > 1 and all(is_static(c) for c in copies)  # the timing reads them as the step would
    monkeypatch.setenv("DAYZERO_WEIGHT_PRELOAD", "0")
    assert not preload(x, param)["PRELOAD"]


def test_bf16_tokens_against_fp32_weights_give_fp32_like_the_router():
    x, w, b = operands(2, 64, 2048, torch.bfloat16, torch.float32, True)
    got = L.skinny_linear(x, w, b, out_dtype=torch.float32)
    want = reference(x, w, b, out_dtype=torch.float32)
    assert got.dtype == want.dtype == torch.float32
    close(got, exact(x, w, b), torch.float32)
    close(want, exact(x, w, b), torch.float32)


def test_bf16_in_and_out():
    x, w, b = operands(4, 96, 160, torch.bfloat16, torch.bfloat16, False)
    got = L.skinny_linear(x, w, b)
    assert got.dtype == torch.bfloat16
    close(got, exact(x, w, b), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_in_the_epilogue_matches_fp64_and_the_reference(dtype):
    x, w, b = operands(3, 70, 96, dtype, dtype, True)
    add = torch.randn(3, 70, device=DEV).to(dtype)
    want = exact(x, w, b) + add.double()
    for block in L.candidates(3, 70, 96, L.tensor_cores(dtype, dtype)) + [(4, 16, 4)]:
        close(L.skinny_linear(x, w, b, block=block, add=add), want, dtype)
    close(reference(x, w, b, add=add), want, dtype)
    close(reference(x, w, None, add=add), exact(x, w, None) + add.double(), dtype)  # addmm: the add in cuBLAS
    close(reference(x[None], w, None, add=add[None])[0], exact(x, w, None) + add.double(), dtype)  # 3-D x
    assert "add must be" in L.refusal(x, w, b, add=add[:, :8])


@pytest.mark.parametrize("M,N,K", [(2, 37, 100), (5, 130, 96), (8, 64, 512), (3, 16, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tensor_core_blocks_match_fp64_with_rows_padded_to_sixteen(M, N, K, dtype):
    x, w, b = operands(M, N, K, dtype, dtype, True)
    add = torch.randn(M, N, device=DEV).to(dtype)
    blocks = [blk for blk in L.candidates(M, N, K, True) if len(blk) == 4] + [(16, 32, 4, 2)]  # several K steps
    assert len(blocks) >= 2 and not any(len(blk) == 4 for blk in L.candidates(1, N, K, True))  # one row: CUDA cores
    for block in blocks:
        close(L.skinny_linear(x, w, b, block=block), exact(x, w, b), dtype)
        close(L.skinny_linear(x, w, b, block=block, add=add), exact(x, w, b) + add.double(), dtype)
    assert not L.tensor_cores(torch.float32, torch.float32) and not L.tensor_cores(torch.bfloat16, torch.float32)
    x, w, b = operands(M, N, K, torch.float32, torch.float32, True)
    with pytest.raises(ValueError, match="tensor-core block"):  # fp32 would run as TF32: refused, not rounded
        L.skinny_linear(x, w, b, block=blocks[0])


@pytest.mark.parametrize("M,N,K", [(13, 37, 100), (32, 64, 96), (64, 24, 48)], ids=str)
def test_tensor_core_blocks_take_up_to_sixty_four_rows(M, N, K):
    """Decode steps of 9-64 sequences: only tensor-core blocks are timed (rows padded to the next power of two),
    each equal to the product; fp32 operands stay at the CUDA cores' eight rows."""
    x, w, b = operands(M, N, K, torch.bfloat16, torch.bfloat16, True)
    add = torch.randn(M, N, device=DEV).to(torch.bfloat16)
    blocks = L.candidates(M, N, K, True)
    assert blocks and all(len(blk) == 4 for blk in blocks)
    for block in blocks + [(16, 32, 4, 2)]:  # several K steps
        close(L.skinny_linear(x, w, b, block=block, add=add), exact(x, w, b) + add.double(), torch.bfloat16)
    assert L.refusal(x, w, b) is None
    assert "rows" in L.refusal(torch.cat([x] * 5)[:65], w)
    xf, wf, _ = operands(M, N, K, torch.float32, torch.float32, False)
    assert "8 (64 with bf16 or fp16" in L.refusal(xf, wf)


def test_a_block_that_fails_to_run_is_left_out_of_the_linears_choice(monkeypatch, caplog):
    """A tensor-core block this Triton cannot build (shared memory, say) is logged and left out; with none left,
    cuBLAS runs."""
    monkeypatch.setattr(L, "cold_copies", lambda w: [w])
    monkeypatch.setattr(L, "graph_time", lambda calls: [c() for c in calls] and 1.0)
    monkeypatch.setattr(L, "skinny_linear", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("out of resources")))
    x, w, _ = operands(32, 64, 96, torch.bfloat16, torch.bfloat16, False)
    with caplog.at_level("WARNING", logger="dayzero.ops"):
        times = L.timings(x, w)
    assert list(times) == [None] and L.fastest(times) is None
    assert "failed to run" in caplog.text and "out of resources" in caplog.text


def test_strided_rows_and_no_rows():
    x, w, _ = operands(6, 40, 64, torch.float32, torch.float32, False)
    wide = torch.cat([x, x], 1)[:, :64]  # rows 128 apart
    close(L.skinny_linear(wide, w), exact(x, w, None), torch.float32)
    assert L.skinny_linear(x[:0], w).shape == (0, 40)


def test_reference_keeps_one_dtype_gemms_and_upcasts_mixed_ones():
    x, w, b = operands(3, 8, 16, torch.bfloat16, torch.bfloat16, True)
    assert torch.equal(reference(x, w, b), torch.nn.functional.linear(x, w, b))
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert torch.equal(reference(x, w, b, out_dtype=torch.float32), want)


def test_refusals_name_the_reason():
    x, w, b = operands(3, 8, 16, torch.float32, torch.float32, True)
    assert L.refusal(x, w, b) is None
    assert "rows" in L.refusal(x.repeat(3, 1), w)
    assert "rows" in L.refusal(x[:0], w)
    assert "[rows, K]" in L.refusal(x[None], w)
    assert "[rows, K]" in L.refusal(x[:, :8], w)
    assert "contiguous" in L.refusal(x.t().contiguous().t(), w)
    assert "dtypes" in L.refusal(x.double(), w)
    assert "dtypes" in L.refusal(x, w, out_dtype=torch.int32)
    w.requires_grad_(True)
    assert "backward" in L.refusal(x, w)
    with torch.no_grad():
        assert L.refusal(x, w) is None


def test_the_choice_takes_triton_only_past_the_margin():
    a, b = (8, 1024, 4), (4, 2048, 4)
    assert L.fastest({None: 10.0, a: 9.6, b: 9.4}) == b == L.fastest_triton({None: 10.0, a: 9.6, b: 9.4})
    assert L.fastest({None: 10.0, a: 9.6}) is None and L.fastest_triton({None: 10.0, a: 9.6}) == a


def test_on_the_cpu_the_op_keeps_the_reference():
    x, w, b = operands(2, 8, 16, torch.float32, torch.float32, True)
    if DEV == "cpu":
        assert L.measured_choice(x, w, b) is None
        assert torch.equal(ops.call("linear", x, w, b), torch.nn.functional.linear(x, w, b))


@cuda
@pytest.mark.parametrize("M,N,K,x_dtype,w_dtype,out", [
    (1, 1536, 2048, torch.bfloat16, torch.bfloat16, None),  # dayzero-small's LatentMoE input projection
    (4, 2048, 2048, torch.bfloat16, torch.bfloat16, None),
    (1, 64, 2048, torch.bfloat16, torch.float32, torch.float32),  # its router
    (3, 7000, 7168, torch.bfloat16, torch.bfloat16, None),
    (32, 6416, 2048, torch.bfloat16, torch.bfloat16, None),  # its KDA input projection at 32 sequences
    (64, 2048, 2048, torch.bfloat16, torch.bfloat16, None),
], ids=str)
def test_measured_choice_and_every_candidate_on_the_gpu(M, N, K, x_dtype, w_dtype, out):
    x, w, b = operands(M, N, K, x_dtype, w_dtype, False)
    want = exact(x, w, b)
    dtype = out or x_dtype
    mma = L.tensor_cores(x_dtype, w_dtype)
    for block in L.candidates(M, N, K, mma):
        close(L.skinny_linear(x, w, b, out, block), want, dtype)
    choice = L.measured_choice(x, w, b, out)
    assert choice is None or choice in L.candidates(L.next_pow2(M), N, K, mma)
    got = ops.call("linear", x, w, b, out_dtype=out)
    assert got.dtype == dtype
    close(got, want, dtype)


@cuda
@pytest.mark.parametrize("M", [1, 2, 4])
def test_measured_choice_with_an_add_like_the_latent_up_projection(M):
    x, w, _ = operands(M, 2048, 512, torch.bfloat16, torch.bfloat16, False)  # dayzero-small's fc2_latent_proj
    add = torch.randn(M, 2048, device=DEV).to(torch.bfloat16)  # the shared expert's output
    want = exact(x, w, None) + add.double()
    L.measured_choice(x, w, add=add)
    close(ops.call("linear", x, w, add=add), want, torch.bfloat16)


@cuda
def test_replayed_in_a_cuda_graph():
    x, w, _ = operands(2, 512, 1024, torch.bfloat16, torch.bfloat16, False)
    block = L.candidates(2, 512, 1024)[0]
    L.skinny_linear(x, w, block=block)  # compiled outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = L.skinny_linear(x, w, block=block)
    x.copy_(torch.randn_like(x))
    graph.replay()
    close(y, exact(x, w, None), torch.bfloat16)


# --- rms_norm_linear: the norm inside the skinny kernel --------------------------------------------------------
def norm_exact(x, r, g, eps, w, b):
    """fp64: (the projection of the normalised rows, the normalised rows, the sum), the sum rounded to x's dtype
    as the rms_norm op rounds it."""
    s = x if r is None else (x.float() + r.float()).to(x.dtype)
    h = s.double()
    n = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * g.double()
    return exact(n, w, b), n, s


def same_sum(got, want):
    """The residual sum rounded as the rms_norm op rounds it; Triton's interpreter truncates fp32 -> bf16 casts
    (a GPU rounds to nearest), so there it is only close."""
    if got.dtype == torch.float32 or got.is_cuda:
        assert torch.equal(got, want)
    else:
        close(got, want.double(), got.dtype)


@pytest.mark.parametrize("M,N,K", [(1, 37, 100), (2, 64, 256), (5, 130, 48), (24, 40, 64)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["first", "residual"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_norm_in_the_kernel_matches_fp64_and_the_reference(M, N, K, residual, dtype):
    x, w, b = operands(M, N, K, dtype, dtype, True)
    g = torch.Generator(DEV).manual_seed(1)
    r = (3 * torch.randn(M, K, generator=g, device=DEV)).to(dtype) if residual else None
    gw = (1 + 0.1 * torch.randn(K, generator=g, device=DEV)).float()  # an offset norm's fp32 (1 + w)
    want_y, want_n, want_s = norm_exact(x, r, gw, 1e-6, w, b)
    # several K steps, a ragged last one; (16, 16, 4): fewer programs than K steps, some writing several
    for block in L.candidates(M, N, K, L.tensor_cores(dtype, dtype)) + [(4, 16, 4), (16, 16, 4)]:
        y, n, s = NL.norm_skinny_linear(x, r, gw, 1e-6, w, b, block)
        close(y, want_y, dtype)
        close(n, want_n, dtype)
        assert r is not None or s is x
        same_sum(s, want_s)
    ry, rn, rs = reference_norm(x, r, gw, 1e-6, w, b)  # the two ops apart
    close(ry, want_y, dtype)
    close(rn, want_n, dtype)
    assert torch.equal(rs, want_s)


@pytest.mark.parametrize("M,K", [(1, 100), (3, 256), (8, 48)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["first", "residual"])
def test_router_norm_reads_the_rows_the_norm_op_writes(M, K, residual):
    """A bf16 model's router: fp32 weight and logits. The fused launch (``rounded``) takes the rows' scale in a
    first pass and multiplies the normalised rows rounded to bf16, as the two ops apart do: its logits are the
    product of exactly the rows it writes (up to the fp32 sums' order), where the factored norm's differ from them
    by the rows' rounding. (Triton's interpreter truncates fp32 to bf16 where a GPU rounds to nearest, so the
    rows are compared with the norm op's within a bf16 step, as elsewhere here.)"""
    E = 20
    g = torch.Generator(DEV).manual_seed(2)
    x = (2 * torch.randn(M, K, generator=g, device=DEV)).to(torch.bfloat16)
    r = torch.randn(M, K, generator=g, device=DEV).to(torch.bfloat16) if residual else None
    gw = (1 + 0.1 * torch.randn(K, generator=g, device=DEV)).to(torch.bfloat16)
    w = torch.randn(E, K, generator=g, device=DEV) / K ** 0.5
    b = 0.1 * torch.randn(E, generator=g, device=DEV)
    assert NL.rounded(x, w, torch.float32) and not NL.rounded(x, x.new_empty(E, K), None)
    ry, rn, rs = reference_norm(x, r, gw, 1e-6, w, b, torch.float32)  # the two ops apart
    assert ry.dtype == torch.float32
    for block in L.candidates(M, E, K) + [(4, 16, 4)]:  # several K steps in both passes
        y, n, s = NL.norm_skinny_linear(x, r, gw, 1e-6, w, b, block, torch.float32)
        assert y.dtype == torch.float32
        close(n, rn, torch.bfloat16)
        same_sum(s, rs)
        exact = n.double() @ w.double().T + b.double()  # the rows the kernel wrote, multiplied in fp64
        torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(y, ry, rtol=2e-2, atol=2e-2)
    assert NL.rounded(x, w, None)  # an fp32 weight alone asks for the rounded rows too
    # the factored norm's logits (its scale applied after the product) miss the rows' rounding: told apart here
    factored = torch.empty_like(ry)
    L.launch(x, w, factored, K, (4, 16, 4), bias=b, eps=1e-6,
             norm=(gw, r, torch.empty_like(x), x if r is None else torch.empty_like(x)))
    assert not torch.allclose(factored.double(), exact, rtol=1e-5, atol=1e-5)


def test_norm_refusals_name_the_reason():
    x, w, _ = operands(2, 8, 16, torch.float32, torch.float32, False)
    g = torch.ones(16, device=DEV)
    assert "weight of the rows' width" in NL._verify_norm(x, None, g[:8], 1e-6, w)
    assert "residual" in NL._verify_norm(x, x[:1], g, 1e-6, w)
    assert "residual" in NL._verify_norm(x, x.double(), g, 1e-6, w)
    assert "rows" in NL._verify_norm(x.repeat(5, 1), None, g, 1e-6, w)


def test_a_fused_launch_is_measured_where_the_linear_alone_keeps_cublas(monkeypatch):
    """The norm, gated norm, activation and gate launches are judged by their own measurement (fused against the
    op apart, then the linear's choice), not refused because the plain product measured cuBLAS faster: the op
    apart would still cost its launch."""
    x, w, b = operands(2, 24, 64, torch.float32, torch.float32, True)
    heads, g = x.view(2, 4, 16), torch.ones(64, device=DEV)
    block = (4, 16, 4)
    monkeypatch.setattr(L, "measured_choice", lambda *a, **k: None)  # the plain product: cuBLAS
    assert "cuBLAS" in L._verify(x, w, b)
    verdicts = lambda: (NL._verify_norm(x, x, g, 1e-6, w, b),  # noqa: E731
                        NL._verify_gated(heads, g[:16], heads, 1e-6, w, b),
                        AL._verify_act(torch.cat([x, x], 1), w, b, "silu"),
                        AL._verify_gate(heads, heads[..., :1], w, b))
    for module, name in ((NL, "measured_choice"), (NL, "gated_choice"), (AL, "measured_choice"), (AL, "gate_choice")):
        monkeypatch.setattr(module, name, lambda *a, **k: block)
    assert verdicts() == (None, None, None, None)
    for module, name in ((NL, "measured_choice"), (NL, "gated_choice"), (AL, "measured_choice"), (AL, "gate_choice")):
        monkeypatch.setattr(module, name, lambda *a, **k: None)  # the fused launch measured slower
    assert all("measured" in why for why in verdicts())


@cuda
@pytest.mark.parametrize("M", [1, 2])
def test_norm_linear_op_at_the_kda_input_projection(M):
    x, w, _ = operands(M, 6416, 2048, torch.bfloat16, torch.bfloat16, False)  # dayzero-small's KDA fused_in
    r = torch.randn(M, 2048, device=DEV).to(torch.bfloat16)
    gw = torch.rand(2048, device=DEV).to(torch.bfloat16)
    want_y, want_n, want_s = norm_exact(x, r, gw, 1e-6, w, None)
    L.measured_choice(x, w)
    choice = NL.measured_choice(x, r, gw, 1e-6, w)  # fused, or None: the two apart measured faster
    assert choice is None or choice in L.candidates(L.next_pow2(M), 6416, 2048, True)
    y, n, s = ops.call("rms_norm_linear", x, r, gw, 1e-6, w, None)
    close(y, want_y, torch.bfloat16)
    close(n, want_n, torch.bfloat16)
    assert torch.equal(s, want_s)


# --- act_linear: the MLP's activation inside the skinny kernel -------------------------------------------------
ACTIVATIONS = [("silu", None), ("silu", 3.0), ("swiglu_oai", None), ("relu2", None)]


def act_exact(x, activation, limit, w, b, add):
    """fp64 product of the activation op's rows (rounded to x's dtype, as the op writes them)."""
    y = exact(_act_reference(x, activation, limit), w, b)
    return y if add is None else y + add.double()


def _act_reference(x, activation, limit):
    from dayzero.ops.activation import reference as A

    if activation == "silu":
        return A.silu_and_mul(x, limit)
    if activation == "swiglu_oai":
        return A.swiglu_oai(x, limit=7.0 if limit is None else limit)
    return A.relu2(x)


@pytest.mark.parametrize("M,N,I", [(1, 37, 100), (3, 64, 48), (5, 24, 33), (24, 40, 32)], ids=str)
@pytest.mark.parametrize("activation,limit", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_activation_in_the_kernel_matches_fp64_and_the_reference(M, N, I, activation, limit, dtype):
    parts = L.ACTS[activation][1]
    g = torch.Generator(DEV).manual_seed(2)
    x = (3 * torch.randn(M, parts * I, generator=g, device=DEV)).to(dtype)  # past the clamp now and then
    _, w, b = operands(M, N, I, dtype, dtype, True)
    add = torch.randn(M, N, generator=g, device=DEV).to(dtype)
    clamp = 7.0 if activation == "swiglu_oai" and limit is None else limit
    for bias, extra in ((None, None), (b, add)):
        want = act_exact(x, activation, limit, w, bias, extra)
        for block in L.candidates(M, N, I, L.tensor_cores(dtype, dtype)) + [(4, 16, 4)]:  # several K steps
            close(L.skinny_linear(x, w, bias, None, block, extra, activation, clamp), want, dtype)
        close(reference_act(x, w, bias, activation, limit, extra), want, dtype)  # the two ops apart


def test_activation_refusals_name_the_reason():
    x, w, _ = operands(2, 8, 32, torch.float32, torch.float32, False)
    assert "unknown activation" in AL._verify_act(x, w[:, :16], None, "gelu")
    assert "rows of 2 x" in AL._verify_act(x, w, None, "silu")  # silu reads [gate | up]: 2 x 32 columns
    assert "rows" in AL._verify_act(x.repeat(5, 1), w[:, :16], None, "silu")
    with pytest.raises(ValueError, match="unknown activation"):
        reference_act(x, w[:, :16], None, "gelu")


def test_on_the_cpu_act_linear_keeps_the_two_ops():
    x, w, b = torch.randn(2, 32), torch.randn(8, 32), torch.randn(8)
    assert AL.measured_choice(x, w[:, :16], b, "silu") is None
    want = torch.nn.functional.linear(torch.nn.functional.silu(x[:, :16]) * x[:, 16:], w[:, :16], b)
    torch.testing.assert_close(ops.call("act_linear", x, w[:, :16].contiguous(), b, "silu"), want)


@cuda
@pytest.mark.parametrize("M,N,I", [(1, 2048, 512), (2, 2048, 5632)], ids=str)  # shared expert, dense MLP
def test_act_linear_op_at_dayzero_small_shapes(M, N, I):
    g = torch.Generator(DEV).manual_seed(3)
    x = torch.randn(M, 2 * I, generator=g, device=DEV).to(torch.bfloat16)
    _, w, _ = operands(M, N, I, torch.bfloat16, torch.bfloat16, False)
    want = act_exact(x, "silu", None, w, None, None)
    choice = AL.measured_choice(x, w, None, "silu")  # fused, or None: the two apart measured faster
    assert choice is None or choice in L.candidates(L.next_pow2(M), N, I, True)
    close(ops.call("act_linear", x, w, None, "silu"), want, torch.bfloat16)


# --- rms_norm_gated_linear: KDA's gated output norm inside the skinny kernel ----------------------------------
def gated_exact(x, g, gw, eps, w, b):
    """fp64 product of the gated norm's rows (rounded to x's dtype, as the rms_norm_gated op writes them)."""
    from dayzero.ops.norm.reference import rms_norm_gated

    return exact(rms_norm_gated(x, gw, g, eps).reshape(x.shape[0], -1), w, b)


@pytest.mark.parametrize("M,N,H,V", [(1, 37, 3, 32), (3, 64, 4, 16), (5, 24, 2, 64), (24, 40, 2, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gated_norm_in_the_kernel_matches_fp64_and_the_reference(M, N, H, V, dtype):
    g = torch.Generator(DEV).manual_seed(4)
    x = (2 * torch.randn(M, H, V, generator=g, device=DEV)).to(dtype)
    both = torch.randn(M, 2 * H * V, generator=g, device=DEV).to(dtype)  # the gate is a column slice, as in KDA
    gate = both[:, H * V:].view(M, H, V)
    gw = (1 + 0.1 * torch.randn(V, generator=g, device=DEV)).to(dtype)
    _, w, b = operands(M, N, H * V, dtype, dtype, True)
    for bias in (None, b):
        want = gated_exact(x, gate, gw, 1e-6, w, bias)
        for block in NL.gated_candidates(M, N, H * V, V, L.tensor_cores(dtype, dtype)) + [(4, V, 4)]:  # a head a step
            close(NL.gated_norm_skinny_linear(x, gw, gate, 1e-6, w, bias, block), want, dtype)
        close(reference_gated(x, gw, gate, 1e-6, w, bias), want, dtype)  # the two ops apart


def test_gated_norm_refusals_name_the_reason():
    x, gate = torch.randn(2, 4, 32, device=DEV), torch.randn(2, 4, 32, device=DEV)
    w, gw = torch.randn(8, 128, device=DEV), torch.ones(32, device=DEV)
    assert "[rows, heads, head_dim]" in NL._verify_gated(x.view(2, -1), gw, gate.view(2, -1), 1e-6, w)
    assert "power of two" in NL._verify_gated(x[..., :24], gw[:24], gate[..., :24], 1e-6, w[:, :96])
    assert "side by side" in NL._verify_gated(x.transpose(0, 1).contiguous().transpose(0, 1), gw, gate, 1e-6, w)
    assert "norm weight" in NL._verify_gated(x, gw[:16], gate, 1e-6, w)
    assert "rows" in NL._verify_gated(x.repeat(5, 1, 1), gw, gate.repeat(5, 1, 1), 1e-6, w)


@cuda
@pytest.mark.parametrize("M", [1, 2])
def test_gated_norm_linear_op_at_the_kda_output_projection(M):
    g = torch.Generator(DEV).manual_seed(5)
    x = torch.randn(M, 16, 128, generator=g, device=DEV).to(torch.bfloat16)  # dayzero-small's KDA heads
    gate = torch.randn(M, 2, 2048, generator=g, device=DEV).to(torch.bfloat16)[:, 1].view(M, 16, 128)
    gw = torch.rand(128, generator=g, device=DEV).to(torch.bfloat16)
    _, w, _ = operands(M, 2048, 2048, torch.bfloat16, torch.bfloat16, False)
    choice = NL.gated_choice(x, gw, gate, 1e-6, w)  # fused, or None: the two apart measured faster
    assert choice is None or choice in NL.gated_candidates(L.next_pow2(M), 2048, 2048, 128, True)
    close(ops.call("rms_norm_gated_linear", x, gw, gate, 1e-6, w), gated_exact(x, gate, gw, 1e-6, w, None),
          torch.bfloat16)


def test_the_fused_timings_run_every_launch_they_compare(monkeypatch):
    """What the three fused ops time at a key's first eager call on a GPU, run here eagerly (the graph replay and
    the L2-cold copies replaced): each apart and fused call runs and gives the same product."""
    outputs = []

    def eager(calls, replays=5):
        y = [c() for c in calls][0]
        outputs.append(y[0] if isinstance(y, tuple) else y)  # rms_norm_linear's launch gives (y, normed, sum)
        return float(len(outputs))

    monkeypatch.setattr(L, "graph_time", eager)
    monkeypatch.setattr(L, "cold_copies", lambda w: [w])  # (dual_linear's: both weights, one copy each)
    for linear_choice in (None, (4, 16, 4)):  # the linear's own choice: cuBLAS, or a Triton block
        monkeypatch.setattr(L, "measured_choice", lambda *a, **k: linear_choice)
        g = torch.Generator(DEV).manual_seed(6)
        r = lambda *shape: torch.randn(*shape, generator=g, device=DEV)  # noqa: E731
        u = lambda *shape: torch.rand(*shape, generator=g, device=DEV)  # noqa: E731
        x, w, b = r(2, 64), r(24, 64), r(24)
        runs = (lambda: NL.timings(x, x, u(64), 1e-6, w, b),
                lambda: AL.timings(r(2, 128), w, b, "silu", None, r(2, 24)),
                lambda: NL.gated_timings(x.view(2, 4, 16), u(16), x.view(2, 4, 16), 1e-6, w, b),
                lambda: AL.dual_timings(x, w, r(2, 96), r(24, 48), "silu"),
                lambda: AL.gate_timings(x.view(2, 4, 16), r(2, 4, 1), w, b))
        for run in runs:
            outputs.clear()
            times = run()
            assert None in times and len(times) >= 2 and len(outputs) == len(times)
            for y in outputs[1:]:  # the timings draw their own random rows: apart and fused see the same ones
                close(y, outputs[0].double(), torch.float32)


# --- dual_linear: a second product (the shared expert) summed in the same launch ---------------------------------
@pytest.mark.parametrize("M,N,K1,K2", [(1, 37, 100, 48), (3, 64, 32, 96), (5, 24, 64, 64), (24, 40, 32, 64)], ids=str)
@pytest.mark.parametrize("activation,limit", [(None, None), ("silu", None), ("silu", 3.0), ("relu2", None)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_two_products_in_one_launch_match_fp64_and_the_reference(M, N, K1, K2, activation, limit, dtype):
    parts = 1 if activation is None else L.ACTS[activation][1]
    g = torch.Generator(DEV).manual_seed(7)
    x, w, _ = operands(M, N, K1, dtype, dtype, False)
    x2 = (3 * torch.randn(M, parts * K2, generator=g, device=DEV)).to(dtype)
    w2 = (torch.randn(N, K2, generator=g, device=DEV) / K2 ** 0.5).to(dtype)
    h = x2 if activation is None else _act_reference(x2, activation, limit)
    want = exact(x, w, None) + exact(h, w2, None)
    for block in AL.dual_candidates(M, N, K1, K2, L.tensor_cores(dtype, dtype)) + [(4, 16, 4)]:  # several K steps
        close(AL.dual_skinny_linear(x, w, x2, w2, activation, limit, block), want, dtype)
    close(reference_dual(x, w, x2, w2, activation, limit), want, dtype)  # act_linear, then linear with its sum


def test_dual_refusals_name_the_reason():
    x, w, x2, w2 = torch.randn(2, 32), torch.randn(8, 32), torch.randn(2, 48), torch.randn(8, 24)
    assert "unknown activation" in AL._verify_dual(x, w, x2, w2, "gelu")
    assert "x2 needs the rows of x with 1 x" in AL._verify_dual(x, w, x2, w2)
    assert "x2 needs the rows of x" in AL._verify_dual(x, w, x2[:1], w2, "silu")
    assert "same out-features" in AL._verify_dual(x, w, x2, w2[:4], "silu")
    assert "rows" in AL._verify_dual(x.repeat(5, 1), w, x2.repeat(5, 1), w2, "silu")


@cuda
@pytest.mark.parametrize("M", [1, 2])
def test_dual_linear_op_at_the_latent_up_projection(M):
    g = torch.Generator(DEV).manual_seed(8)
    y = torch.randn(M, 512, generator=g, device=DEV).to(torch.bfloat16)  # dayzero-small's latent rows
    sh = torch.randn(M, 1024, generator=g, device=DEV).to(torch.bfloat16)  # its shared expert's [gate | up]
    w, w2 = ((torch.randn(2048, 512, generator=g, device=DEV) / 512 ** 0.5).to(torch.bfloat16) for _ in range(2))
    want = exact(y, w, None) + act_exact(sh, "silu", None, w2, None, None)
    choice = AL.dual_choice(y, w, sh, w2, "silu")  # one launch, or None: the ops apart measured faster
    assert choice is None or choice in AL.dual_candidates(L.next_pow2(M), 2048, 512, 512, True)
    close(ops.call("dual_linear", y, w, sh, w2, "silu"), want, torch.bfloat16)


def test_a_fused_launch_that_fails_to_run_is_left_out_of_the_choice(monkeypatch, caplog):
    def graph_time(calls, replays=5):
        return [c() for c in calls][0]

    monkeypatch.setattr(L, "graph_time", graph_time)
    monkeypatch.setattr(L, "cold_copies", lambda w: [w])

    def fused(w, b):
        if b == (8, 64, 4):
            raise RuntimeError("cannot build")
        return 1.0

    with caplog.at_level("WARNING", logger="dayzero.ops"):
        times = L.fused_timings(torch.ones(1), lambda w: 2.0, fused, [(8, 64, 4), (4, 64, 4)])
    assert times == {None: 2.0, (4, 64, 4): 1.0} and "cannot build" in caplog.text
    assert L.fused_choice("x", times) == (4, 64, 4)
    assert L.fused_choice("x", {None: 2.0}) is None  # no fused launch ran: apart


# --- sigmoid_gate_linear: gated attention's output gate inside the skinny kernel ------------------------------
@pytest.mark.parametrize("M,N,H,V", [(1, 37, 3, 32), (3, 64, 4, 24), (5, 24, 2, 64), (24, 40, 2, 32)], ids=str)
@pytest.mark.parametrize("per_head", [False, True], ids=["per-channel", "per-head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_output_gate_in_the_kernel_matches_fp64_and_the_reference(M, N, H, V, per_head, dtype):
    from dayzero.ops.activation.reference import sigmoid_gate

    g = torch.Generator(DEV).manual_seed(9)
    x = torch.randn(H, M, V, generator=g, device=DEV).to(dtype).transpose(0, 1)  # heads apart, as MLA's output
    wide = torch.randn(M, H, 2 * V, generator=g, device=DEV).to(dtype)  # the gate a strided view, as GQA's
    gate = wide[..., :1] if per_head else wide[..., V:]
    _, w, b = operands(M, N, H * V, dtype, dtype, True)
    for bias in (None, b):
        want = exact(sigmoid_gate(x, gate).reshape(M, -1), w, bias)
        for block in L.candidates(M, N, H * V, L.tensor_cores(dtype, dtype)) + [(4, 16, 4)]:  # several K steps
            close(AL.gate_skinny_linear(x, gate, w, bias, block), want, dtype)
        close(reference_gate(x, gate, w, bias), want, dtype)


def test_output_gate_refusals_name_the_reason():
    x, w = torch.randn(2, 4, 8), torch.randn(6, 32)
    assert "[rows, heads, 1]" in AL._verify_gate(x, torch.randn(2, 4, 3), w)
    assert "contiguous channels" in AL._verify_gate(x.transpose(1, 2).contiguous().transpose(1, 2),
                                                    torch.randn(2, 4, 1), w)
    assert "rows" in AL._verify_gate(x.repeat(5, 1, 1), torch.randn(10, 4, 8), w)


@cuda
@pytest.mark.parametrize("M", [1, 2])
def test_output_gate_linear_op_at_the_dsa_output_projection(M):
    g = torch.Generator(DEV).manual_seed(10)
    x = torch.randn(M, 16, 128, generator=g, device=DEV).to(torch.bfloat16)  # dayzero-small's DSA heads
    gate = torch.randn(M, 16, 128, generator=g, device=DEV).to(torch.bfloat16)
    _, w, _ = operands(M, 2048, 2048, torch.bfloat16, torch.bfloat16, False)
    choice = AL.gate_choice(x, gate, w)  # fused, or None: the two apart measured faster
    assert choice is None or choice in L.candidates(L.next_pow2(M), 2048, 2048)
    want = exact((x.double() * torch.sigmoid(gate.double())).to(torch.bfloat16).reshape(M, -1), w, None)
    close(ops.call("sigmoid_gate_linear", x, gate, w), want, torch.bfloat16)
