"""MXFP4 experts through the shared workspace: BF16 and FP8 workspaces equal dequantize-then-matmul,
one workspace serves every MoE layer, and packed experts never exist twice in full precision."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import LLM, SamplingParams
from dayzero.config.model_config import HybridConfig
from dayzero.layers.moe import MoE
from dayzero.models.init import init_random_weights
from dayzero.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from dayzero.quant.workspace import ExpertWorkspace
from dayzero.tools.build_default_model import build_checkpoint
from dayzero.tools.quantize import quantize_checkpoint
from tests.conftest import tiny_config
from tests.engine.test_incremental import run_chunks

# expert widths that are multiples of the 32-element MX block
MX = dict(moe_intermediate_size=32, moe_latent_size=64, n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1)


def _packed_layer(seed: int = 0) -> MoE:
    spec = HybridConfig.from_dict(tiny_config(**MX, quantization_config={"quant_method": "mxfp4"})).to_spec()
    moe = MoE(spec.hidden_size, spec.layers[-1].mlp).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("w1", "w2"):
            blocks, scales = quantize_mxfp4(torch.randn(getattr(moe, f"{name}_blocks").shape[:-2] + (getattr(moe, f"{name}_blocks").shape[-2] * 32,), generator=g))
            getattr(moe, f"{name}_blocks").copy_(blocks)
            getattr(moe, f"{name}_scales").copy_(scales)
    return moe


@pytest.mark.parametrize("compute", ["bf16", "fp8"])
def test_workspace_equals_dequantize_then_matmul(compute):
    from dayzero.ops.moe.reference import grouped_experts

    moe = _packed_layer()
    ws = ExpertWorkspace(compute)
    w1, w2 = ws.acquire(moe)
    x = torch.randn(9, moe.w1_blocks.shape[-2] * 32, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 5], [2, 2], [4, 0], [5, 1], [3, 4], [0, 1], [2, 5], [1, 3]])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(2))
    got = grouped_experts(x, ids, weights, w1, w2, "silu")
    d1 = dequantize_mxfp4(moe.w1_blocks, moe.w1_scales, torch.float32)
    d2 = dequantize_mxfp4(moe.w2_blocks, moe.w2_scales, torch.float32)
    ref = torch.zeros_like(x)
    for t in range(9):  # dequantize, then a plain per-token loop
        for e, w in zip(ids[t].tolist(), weights[t]):
            gate, up = (d1[e] @ x[t]).chunk(2)
            ref[t] += w * (d2[e] @ (torch.nn.functional.silu(gate) * up))
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-6, rel  # fp32 summation order only: the workspace holds the MXFP4 values exactly
    if compute == "fp8":
        assert w1.data.dtype == torch.float8_e4m3fn  # E2M1 codes held exactly as E4M3, scales beside them


def test_auto_reads_packed_weights_for_small_steps_and_converts_for_large_ones():
    """``auto`` chooses per step: at most ``fused_rows`` rows per expert read the packed weights, more convert
    into a bf16 workspace; either way the experts compute the same product."""
    from dayzero.ops.moe.reference import grouped_experts
    from dayzero.quant.workspace import PackedMXFP4

    a, b = _packed_layer(0), _packed_layer(1)
    ws = ExpertWorkspace("auto", fused_rows=4)
    assert ws.num_slots == 1 and ws.reads_packed(4) and not ws.reads_packed(4.5) and not ws.reads_packed(None)
    x = torch.randn(9, a.w1_blocks.shape[-2] * 32, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[0, 3], [1, 5], [2, 2], [4, 0], [5, 1], [3, 4], [0, 1], [2, 5], [1, 3]])
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(2))
    packed = ws.acquire(a, 3.0)
    ws.prefetch(b, 3.0)
    assert all(isinstance(w, PackedMXFP4) for w in packed) and ws.conversions == 0 and ws.nbytes == 0
    converted = ws.acquire(a, 12.0)
    assert all(w.dtype == torch.bfloat16 for w in converted) and ws.conversions == 1
    torch.testing.assert_close(grouped_experts(x, ids, weights, *packed, "silu"),
                               grouped_experts(x, ids, weights, *converted, "silu"), rtol=1e-6, atol=1e-6)
    ws.acquire(a)  # rows unknown: converted (here already in the slot)
    assert ws.conversions == 1
    with pytest.raises(ValueError, match="expert_compute must be one of"):
        ExpertWorkspace("mxfp4")


@pytest.fixture(scope="module")
def mx_ckpts(tmp_path_factory):
    dense = build_checkpoint(tmp_path_factory.mktemp("dense"), tiny_config(**MX), seed=4, std=0.05)
    packed = tmp_path_factory.mktemp("mxfp4")
    stats = quantize_checkpoint(dense, packed, progress=False)
    # the same model with every expert weight replaced by its dequantized MXFP4 value, stored dense
    ref = tmp_path_factory.mktemp("dequantized")
    for f in dense.iterdir():
        if f.is_file():
            (ref / f.name).write_bytes(f.read_bytes())
    t, q = load_file(str(dense / "model.safetensors")), load_file(str(packed / "model.safetensors"))
    for name in list(t):
        if name + "_blocks" in q:
            t[name] = dequantize_mxfp4(q[name + "_blocks"], q[name + "_scales"], torch.float32)
    save_file(t, str(ref / "model.safetensors"))
    return dense, packed, ref, stats


def test_quantize_tool_output(mx_ckpts):
    dense, packed, _, stats = mx_ckpts
    assert json.loads((packed / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    n_moe = sum(1 for i in range(4) if i >= tiny_config()["first_k_dense_replace"])
    assert stats["quantized"] == 2 * n_moe
    q = load_file(str(packed / "model.safetensors"))
    assert not any(k.endswith(".w1") or k.endswith(".w2") for k in q)
    assert (packed / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(packed, packed.parent / "again", progress=False)


@pytest.mark.parametrize("compute", ["auto", "bf16", "fp8", "fused"])
def test_packed_model_equals_dequantized_dense_model(mx_ckpts, compute):
    _, packed, ref, _ = mx_ckpts
    kw = dict(device="cpu", dtype="float32", num_cache_blocks=64)
    ours = LLM(str(packed), expert_compute=compute, **kw)
    dense = LLM(str(ref), **kw)
    toks = list(range(5, 40))
    a, b = run_chunks(ours.engine, toks, [len(toks)]), run_chunks(dense.engine, toks, [len(toks)])
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    p = [{"prompt_token_ids": toks}]
    assert ours.generate(p, sp)[0].outputs[0].token_ids == dense.generate(p, sp)[0].outputs[0].token_ids


def test_one_workspace_shared_and_memory_accounting(mx_ckpts):
    _, packed, _, _ = mx_ckpts
    for compute, elem in (("bf16", 2.0), ("fp8", 1.0 + 4 / 32)):
        llm = LLM(str(packed), device="cpu", dtype="float32", num_cache_blocks=16, expert_compute=compute)
        eng = llm.engine
        layers = eng.packed_moe_layers
        assert len(layers) == 3 and all(m.workspace is eng.expert_workspace for m in layers)
        # the workspace holds one layer's experts (the largest), not one per layer
        per_layer = max(m.w1_blocks.shape[:2].numel() * m.w1_blocks.shape[2] * 32 + m.w2_blocks.shape[:2].numel() * m.w2_blocks.shape[2] * 32
                        for m in layers)
        assert eng.expert_workspace.nbytes == int(per_layer * elem) * eng.expert_workspace.num_slots
        # the model itself keeps only the packed form: 17 bytes per 32 weights, no dense expert tensors
        for m in layers:
            assert not hasattr(m, "w1") and not hasattr(m, "w2")
            packed_bytes = sum(getattr(m, n).numel() for n in ("w1_blocks", "w1_scales", "w2_blocks", "w2_scales"))
            weights = (m.w1_blocks.shape[:3].numel() + m.w2_blocks.shape[:3].numel()) * 32
            assert packed_bytes * 8 / weights == pytest.approx(4.25)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3))
        assert eng.expert_workspace.conversions >= len(layers)


def test_auto_converts_for_a_long_prefill_and_not_for_decode(mx_ckpts):
    """The engine's default: a 400-token prefill step (133 rows per expert: 400 tokens x top-2 / 6 experts)
    converts each packed layer once; the steps after it (the prompt's last token, then decode: 1 row) convert
    nothing; the output is the dequantised dense model's."""
    _, packed, ref, _ = mx_ckpts
    kw = dict(device="cpu", dtype="float32", num_cache_blocks=64, max_num_batched_tokens=512)
    llm = LLM(str(packed), **kw)
    eng = llm.engine
    assert eng.expert_workspace.compute == "auto"
    toks = [5 + (i * 7) % 90 for i in range(401)]  # the prefix cache's snapshot point ends the first step at 400
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    ours = llm.generate([{"prompt_token_ids": toks}], sp)[0].outputs[0].token_ids
    assert eng.expert_workspace.conversions == len(eng.packed_moe_layers)  # the prefill step's, none after
    dense = LLM(str(ref), **kw).generate([{"prompt_token_ids": toks}], sp)[0].outputs[0].token_ids
    assert ours == dense


def test_fused_mode_converts_nothing_and_holds_nothing(mx_ckpts):
    _, packed, _, _ = mx_ckpts
    llm = LLM(str(packed), device="cpu", dtype="float32", num_cache_blocks=16, expert_compute="fused")
    ws = llm.engine.expert_workspace
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert ws.nbytes == 0 and ws.conversions == 0 and ws.num_slots == 0


def test_high_precision_layers_dequantize_once(mx_ckpts):
    _, packed, ref, _ = mx_ckpts
    kw = dict(device="cpu", dtype="float32", num_cache_blocks=64)
    llm = LLM(str(packed), high_precision_layers=[2], **kw)
    layer2 = llm.engine.model.model.layers[2].mlp
    assert not layer2.packed and layer2.w1.dtype == torch.float32
    assert len(llm.engine.packed_moe_layers) == 2
    toks = list(range(7, 30))
    torch.testing.assert_close(run_chunks(llm.engine, toks, [len(toks)]), run_chunks(LLM(str(ref), **kw).engine, toks, [len(toks)]),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="high_precision_layers"):
        LLM(str(packed), high_precision_layers=[99], **kw)


def test_quantize_rejects_widths_that_are_not_whole_blocks(tmp_path):
    src = build_checkpoint(tmp_path / "src", tiny_config(), seed=0, tokenizer=False)  # moe_intermediate_size 24
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_checkpoint(src, tmp_path / "dst", progress=False)


def test_quantize_rejects_unknown_layouts(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    with pytest.raises(ValueError, match="supported: .*dayzero_hybrid.*gpt_oss"):
        quantize_checkpoint(tmp_path / "src", tmp_path / "dst", progress=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compute", ["auto", "bf16", "fp8"])
def test_cuda_double_buffered_workspace_equals_cpu(mx_ckpts, compute):
    """On CUDA the next layer's experts convert on a side stream while this layer computes."""
    _, packed, _, _ = mx_ckpts
    kw = dict(dtype="float32", num_cache_blocks=64, expert_compute=compute)
    gpu = LLM(str(packed), device="cuda", **kw)
    assert gpu.engine.expert_workspace.num_slots == 2
    toks = list(range(5, 60))
    a = run_chunks(gpu.engine, toks, [len(toks)]).cpu()
    b = run_chunks(LLM(str(packed), device="cpu", **kw).engine, toks, [len(toks)])
    rel = ((a - b).norm() / b.norm()).item()
    assert rel < 1e-4, rel
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    p = [{"prompt_token_ids": toks[:n]} for n in (5, 17, 40)]
    outs = [o.outputs[0].token_ids for o in gpu.generate(p, sp)]
    assert all(len(o) == 12 for o in outs)


# ---------------------------------------------------------------- steps, CUDA graphs

def test_invalidate_forgets_the_slots():
    moe = _packed_layer()
    ws = ExpertWorkspace("bf16")
    first = ws.acquire(moe)[0].clone()
    ws.acquire(moe)
    assert ws.conversions == 1  # the slot still holds this layer
    ws._slots[0]["w1"].fill_(float("nan"))  # what a replay or another step may have left there
    ws.invalidate()
    torch.testing.assert_close(ws.acquire(moe)[0], first)
    assert ws.conversions == 2


def test_while_capturing_every_acquire_converts_and_prefetch_does_nothing(monkeypatch):
    import dayzero.quant.workspace as workspace

    a, b = _packed_layer(0), _packed_layer(1)
    ws = ExpertWorkspace("fp8")
    monkeypatch.setattr(workspace, "_capturing", lambda device: True)
    for _ in range(3):
        ws.acquire(a)
        ws.prefetch(b)
        ws.release(a)
    assert ws.conversions == 3 and ws._owner == [None]  # nothing cached for a replay to trust


def test_conversion_builds_no_tensor_from_host_data():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    moe = _packed_layer()
    ws = ExpertWorkspace("bf16")  # the FP4 lookup table is built here, once per device
    with Ops() as mode:
        ws.acquire(moe)
        ws.invalidate()
        ws.acquire(moe)
    assert ws.conversions == 2 and mode.names
    # lift_fresh: a tensor made from host values (a synchronising copy on CUDA); _local_scalar_dense: a read back
    assert not [n for n in mode.names if "lift_fresh" in n or "_local_scalar_dense" in n]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compute", ["auto", "bf16", "fp8"])
def test_workspace_in_a_cuda_graph_replays_like_eager(compute):
    from dayzero.layers.moe import attach_workspace

    layers = torch.nn.ModuleList([_packed_layer(seed) for seed in (0, 1, 2)]).cuda()
    ws = ExpertWorkspace(compute, "cuda")
    attach_workspace(layers, ws)
    x = torch.randn(9, layers[0].gate.in_features, device="cuda")

    def step():
        ws.invalidate()
        h = x
        for m in layers:
            h = h + m(h)
        return h

    with torch.no_grad():
        eager = step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        for slot in ws._slots:  # poison: a graph that trusted an earlier conversion reads NaN (0x7F in E4M3)
            for t in slot.values():
                t.view(torch.uint8).fill_(0x7F) if t.element_size() == 1 else t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        tol = dict(rtol=1e-5, atol=1e-5 * eager.abs().max().item())  # fp32 atomics: summation order only
        torch.testing.assert_close(captured, eager, **tol)
        step()  # eager steps after a replay convert again
        graph.replay()
        torch.testing.assert_close(captured, eager, **tol)


def _tile_case(E=2, N=200, K=320, spread=None, seed=3):
    """Packed MXFP4 [E, N, K/32, 16] codes and scales; ``spread``: scale bytes drawn from 127 +- spread."""
    g = torch.Generator().manual_seed(seed)
    blocks, scales = quantize_mxfp4(torch.randn(E, N, K, generator=g))
    if spread is not None:
        scales = torch.randint(127 - spread, 128 + spread, scales.shape, generator=g, dtype=torch.int32).to(torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fp8_tiles_hold_the_mxfp4_values_exactly(impl):
    """The FP8-activation workspace (one scale per 128x128 tile): codes times the tile scale give the MXFP4 values
    exactly while a tile's block scales span at most 14 binades (edge tiles: N, K not multiples of 128), and
    the Triton kernel (Triton's interpreter on a CPU) writes the PyTorch form's bytes."""
    from dayzero.quant import convert_kernels, workspace
    from dayzero.quant.fp8 import TileScaled

    blocks, scales = _tile_case(spread=7)
    E, N, G = scales.shape
    out = torch.full((E, N, G * 32), float("nan")).to(torch.float8_e4m3fn)
    inv = torch.full((E, 2, 3), float("nan"))
    if impl == "triton":
        pytest.importorskip("triton")
        assert convert_kernels.convert_refusal(blocks, scales, out, inv) is None
        convert_kernels.convert_mxfp4_tiles(blocks, scales, out, inv)
        want, want_inv = torch.empty_like(out), torch.empty_like(inv)
        workspace._convert_tiles_torch(blocks, scales, want, want_inv)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)) and torch.equal(inv, want_inv)
    else:
        workspace._convert_tiles_torch(blocks, scales, out, inv)
    tiled = TileScaled(out, inv)
    for e in range(E):
        assert torch.equal(tiled[e], dequantize_mxfp4(blocks[e], scales[e], torch.float32))


def test_fp8_tiles_past_14_binades_round_below_the_tiles_largest_and_nan_poisons_a_tile():
    from dayzero.quant import convert_kernels, workspace
    from dayzero.quant.fp8 import TileScaled

    blocks, scales = _tile_case(E=1, N=128, K=128, spread=20, seed=4)
    out, inv = torch.empty(1, 128, 128, dtype=torch.float8_e4m3fn), torch.empty(1, 1, 1)
    workspace._convert_tiles_torch(blocks, scales, out, inv)
    want = dequantize_mxfp4(blocks[0], scales[0], torch.float32)
    err = (TileScaled(out, inv)[0] - want).abs().max()
    assert 0 < err <= want.abs().max() * 2**-16
    if convert_kernels.convert_refusal(blocks, scales, out, inv) is None:  # the kernel rounds those values alike
        got, got_inv = torch.empty_like(out), torch.empty_like(inv)
        convert_kernels.convert_mxfp4_tiles(blocks, scales, got, got_inv)
        assert torch.equal(got.float(), out.float()) and torch.equal(got_inv, inv)  # (-0 and 0 alike)
    scales[0, 5, 2] = 0xFF
    workspace._convert_tiles_torch(blocks, scales, out, inv)
    assert inv.isnan().all()


def test_fp8_activation_workspace_products(mx_ckpts):
    """An engine with FP8 activations converts MXFP4 experts into the tile-scaled workspace (``expert_compute``
    fp8, and auto for large steps), whose products take FP8-rounded activations: close to the exact workspace's
    logits, not equal to them."""
    _, packed, _, _ = mx_ckpts
    kw = dict(device="cpu", dtype="float32", num_cache_blocks=64, expert_compute="fp8")
    exact, a8 = LLM(str(packed), **kw), LLM(str(packed), fp8_activations=True, **kw)
    ws = a8.engine.expert_workspace
    assert ws.tiles and not exact.engine.expert_workspace.tiles
    moe = a8.engine.packed_moe_layers[0]
    w1, _ = ws.acquire(moe)
    assert w1.fp8_activations and w1.scale_inv.shape[-2:] == (-(-w1.shape[1] // 128), -(-w1.shape[2] // 128))
    ids = list(range(1, 40))
    lo, la = (run_chunks(llm.engine, ids, [len(ids)]) for llm in (exact, a8))
    rel = ((la - lo).norm() / lo.norm()).item()
    assert 1e-6 < rel < 5e-2, rel


def test_on_a_cpu_small_steps_dequantise_each_expert_once(monkeypatch):
    """``auto`` on a CPU: the experts a small step reads (``w[e]``) are kept, dequantised once for every later
    step, equal to dequantising them anew, counted in ``nbytes``, up to the budget; moving a layer's experts
    (``forget``) drops them. ``fused`` keeps nothing: it is the packed path as stored."""
    from dayzero.quant import workspace as W

    moe = _packed_layer(3)
    calls = []
    real = W.dequantize_mxfp4
    monkeypatch.setattr(W, "dequantize_mxfp4", lambda *a: calls.append(1) or real(*a))
    ws = ExpertWorkspace("auto")
    w1, w2 = ws.acquire(moe, 1.0)
    fresh = [real(moe.w1_blocks[e], moe.w1_scales[e], torch.float32) for e in range(6)]
    for e in (0, 4, 0, 4):
        assert torch.equal(w1[e], fresh[e])
    assert len(calls) == 2 and ws.nbytes == 2 * fresh[0].nbytes
    again, _ = ws.acquire(moe, 1.0)  # the next step: the same experts, not dequantised again
    assert torch.equal(again[4], fresh[4]) and len(calls) == 2
    with torch.no_grad():  # the experts move between slots, in place, as expert rebalancing does
        moe.w1_blocks[4].copy_(moe.w1_blocks[1])
        moe.w1_scales[4].copy_(moe.w1_scales[1])
    ws.forget(moe)
    assert ws.nbytes == 0
    assert torch.equal(ws.acquire(moe, 1.0)[0][4], fresh[1]) and len(calls) == 3

    monkeypatch.setattr(W, "CPU_DEQUANTISED_BYTES", fresh[0].nbytes)  # room for one expert
    small = ExpertWorkspace("auto")
    w1, _ = small.acquire(moe, 1.0)
    w1[0], w1[2], w1[2]
    assert small.nbytes == fresh[0].nbytes and len(calls) == 6  # the second expert is dequantised at each read
    fused = ExpertWorkspace("fused")
    w1, _ = fused.acquire(moe)
    w1[0], w1[0]
    assert fused.dequantised is None and fused.nbytes == 0 and len(calls) == 8
