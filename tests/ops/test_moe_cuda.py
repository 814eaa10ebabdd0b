"""The CUDA routed experts against the fp32 reference: the grouped GEMM path, the masked path every other weight
format takes, and the whole MoE block running without one host synchronisation."""
from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from dayzero import ops
from dayzero.config.model_config import HybridConfig
from dayzero.config.spec import MoESpec
from dayzero.layers.moe import MoE, attach_workspace
from dayzero.models.init import init_random_weights
from dayzero.ops.moe.cuda import grouped_mm_refusal
from dayzero.ops.moe.reference import grouped_experts as reference
from dayzero.ops.moe.reference import grouped_mlp, permute
from dayzero.ops.registry import choose
from dayzero.quant.fp8 import TileScaled, quantize_fp8_blocks
from dayzero.quant.mxfp4 import quantize_mxfp4
from dayzero.quant.workspace import ExpertWorkspace
from tests.conftest import tiny_config

# expert widths that are multiples of the 32-element MX block (and of grouped_mm's 8)
MX = dict(moe_intermediate_size=32, moe_latent_size=64, n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
needs_grouped_mm = pytest.mark.skipif(not hasattr(torch.nn.functional, "grouped_mm"), reason="needs torch's grouped_mm")


def case(T, E, k, D, inter, activation, bias=False, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = inter if activation == "relu2" else 2 * inter
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = r(T, D).to(dtype)
    ids = torch.stack([torch.randperm(E - 1, generator=g, device="cuda")[:k] for _ in range(T)])  # expert E-1 unused
    w = torch.rand(T, k, generator=g, device="cuda")
    w1, w2 = (0.1 * r(E, rows, D)).to(dtype), (0.1 * r(E, D, inter)).to(dtype)
    b1, b2 = (r(E, rows), r(E, D)) if bias else (None, None)
    return x, ids, w, w1, w2, b1, b2


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@needs_grouped_mm
@pytest.mark.parametrize("activation,bias,limit", [("silu", False, None), ("silu", False, 0.5), ("relu2", False, None),
                                                    ("swiglu_oai", True, None)])
@pytest.mark.parametrize("T", [1, 7, 300])
def test_grouped_gemm_matches_reference(T, activation, bias, limit):
    x, ids, w, w1, w2, b1, b2 = case(T, 8, 2, 64, 48, activation, bias, seed=T)
    kw = {} if limit is None else {"limit": limit}
    chosen, impl, why = choose("moe_experts", "cuda", x, ids, w, w1, w2, activation, b1, b2, **kw)
    assert chosen == "cuda", why
    assert grouped_mm_refusal(x, w1, w2) is None
    out = ops.call("moe_experts", x, ids, w, w1, w2, activation, b1, b2, **kw)
    ref = reference(x, ids, w, w1, w2, activation, b1, b2, **kw)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2  # bf16 rounding of the outputs and of act(h)
    # the expert op on its own, on the permuted rows
    order, offsets = permute(ids, 8)
    xs = x[order // 2]
    ys = ops.call("moe_experts_grouped", xs, offsets, w1, w2, activation, b1, b2, **kw)
    assert rel_err(ys, grouped_mlp(xs, offsets, w1, w2, activation, b1, b2, **kw)) < 1e-2


def test_other_weights_take_the_masked_path_with_a_reason():
    x, ids, w, w1, w2, _, _ = case(5, 8, 2, 64, 48, "silu")
    # the CUDA op takes fp32 and unaligned weights (no host sync), and says why grouped_mm does not
    assert choose("moe_experts", "cuda", x.float(), ids, w, w1.float(), w2.float())[0] == "cuda"
    assert "bf16" in grouped_mm_refusal(x.float(), w1.float(), w2.float())
    assert "multiples of 8" in grouped_mm_refusal(x, w1[:, :, :60], w2)
    for args, tol in (((x.float(), ids, w, w1.float(), w2.float()), 1e-5), ((x[:, :60], ids, w, w1[:, :, :60], w2[:, :60]), 1e-2)):
        assert rel_err(ops.call("moe_experts", *args), reference(*args)) < tol


def test_tile_scaled_fp8_experts_match_reference():
    x, ids, w, w1, w2, _, _ = case(11, 8, 2, 64, 48, "silu", dtype=torch.float32)
    t1, t2 = TileScaled(*quantize_fp8_blocks(w1)), TileScaled(*quantize_fp8_blocks(w2))
    assert rel_err(ops.call("moe_experts", x, ids, w, t1, t2), reference(x, ids, w, t1, t2)) < 1e-5


# ---------------------------------------------------------------- no host synchronisation

@contextmanager
def sync_is_an_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def latent_moe(dtype) -> MoE:
    m = HybridConfig.from_dict(tiny_config(**MX)).to_spec()  # widths multiples of 32
    return init_random_weights(MoE(m.hidden_size, m.layers[-1].mlp).float(), seed=1, std=0.2).to("cuda", dtype)


def hash_moe(dtype) -> MoE:
    spec = MoESpec(n_experts=8, top_k=2, intermediate_size=32, router="sqrtsoftplus", hash_routing=True,
                   correction_bias=False)
    moe = init_random_weights(MoE(64, spec, vocab_size=50).float(), seed=2, std=0.2).to("cuda", dtype)
    moe.process_weights_after_loading()
    return moe


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("make", [latent_moe, hash_moe], ids=["latent", "hash"])
def test_moe_forward_never_syncs(make, dtype):
    moe = make(dtype)
    hidden = moe.gate.in_features
    for T in (1, 37):
        x = torch.randn(T, hidden, device="cuda", dtype=dtype)
        batch = SimpleNamespace(input_ids=torch.randint(0, 50, (T,), device="cuda"))
        with torch.no_grad():
            eager = moe(x, batch)  # warm-up: kernels load, choices are logged
            with sync_is_an_error():
                got = moe(x, batch)
        torch.cuda.synchronize()
        assert rel_err(got, eager) < (1e-2 if dtype == torch.bfloat16 else 1e-5)  # fp32 atomics: order only


def packed_moe(seed: int) -> MoE:
    m = HybridConfig.from_dict(tiny_config(**MX, quantization_config={"quant_method": "mxfp4"})).to_spec()
    moe = init_random_weights(MoE(m.hidden_size, m.layers[-1].mlp).float(), seed=seed, std=0.2)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("w1", "w2"):
            blocks = getattr(moe, f"{name}_blocks")
            codes, scales = quantize_mxfp4(0.2 * torch.randn(*blocks.shape[:-2], blocks.shape[-2] * 32, generator=g))
            blocks.copy_(codes)
            getattr(moe, f"{name}_scales").copy_(scales)
    return moe


@pytest.mark.parametrize("compute,dtype", [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp8", torch.float32)])
def test_packed_moe_with_workspace_never_syncs(compute, dtype):
    layers = torch.nn.ModuleList([packed_moe(seed) for seed in (0, 1)]).to("cuda", dtype)
    ws = ExpertWorkspace(compute, "cuda")
    attach_workspace(layers, ws)
    x = torch.randn(13, layers[0].gate.in_features, device="cuda", dtype=dtype)

    def step():
        ws.invalidate()
        return [m(x) for m in layers]

    with torch.no_grad():
        eager = step()
        with sync_is_an_error():
            got = step()
    torch.cuda.synchronize()
    for a, b in zip(got, eager):
        assert rel_err(a, b) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
