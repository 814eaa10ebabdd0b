"""The engine with the device (``cuda``) implementations of every op chosen as on a GPU, their verifiers
included, but run on CPU tensors: greedy tokens equal the reference engine's, in fp32, for each family whose
decode runs through the batch-wide ops. This checks the device decode path in CI, where no GPU exists."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dayzero import LLM, SamplingParams
from dayzero.ops import registry, triton_support
from dayzero.ops.linear import act as linear_act, kernels as linear_kernels, norm as linear_norm
from dayzero.ops.moe import direct_kernels, router_kernels
from tests.engine.families import prompts

KW = dict(device="cpu", dtype="float32", load_format="dummy", block_size=4, num_cache_blocks=256, max_num_seqs=8,
          max_model_len=128)


def reference_and_device_tokens(model_dir, cuda_ops_on_cpu, n: int, max_tokens: int):
    """Greedy tokens of ``n`` prompts from the reference engine and from one choosing the device implementations,
    and the (op, implementation) pairs the device run called."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref_llm = LLM(model_dir, **KW)
    ps = prompts(n, ref_llm.engine.model_config.vocab_size, 2)
    want = [o.outputs[0].token_ids for o in ref_llm.generate(ps, sp)]
    chosen = set()
    hook = lambda op, c, reason, fn, args, kwargs: chosen.add((op, c)) or fn(*args, **kwargs)  # noqa: E731
    cuda_ops_on_cpu()
    prev = registry.set_hook(hook)
    try:
        got = [o.outputs[0].token_ids for o in LLM(model_dir, **KW).generate(ps, sp)]
    finally:
        registry.set_hook(prev)
    return want, got, chosen


def test_device_implementations_give_the_reference_tokens(model_dir, cuda_ops_on_cpu):
    want, got, chosen = reference_and_device_tokens(model_dir, cuda_ops_on_cpu, 5, 24)
    assert any(c == "cuda" for _, c in chosen), chosen  # the device decode paths did run
    assert got == want


def test_device_implementations_run_in_bf16(model_dir, cuda_ops_on_cpu):
    """bf16 through the device paths (dtypes of states, rings, pools and outputs agree)."""
    cuda_ops_on_cpu()
    llm = LLM(model_dir, device="cpu", dtype="bfloat16", load_format="dummy", block_size=4, num_cache_blocks=256,
              max_num_seqs=8, max_model_len=128)
    outs = llm.generate(prompts(3, llm.engine.model_config.vocab_size, 4),
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


def choose_first_blocks(monkeypatch) -> None:
    """Every skinny-kernel choice made as a GPU's timing may make it: the first candidate block, for the linear and
    each op run inside it."""
    def first(choices, key, block):
        choices[key] = block
        return block

    def linear(x, weight, bias=None, out_dtype=None, add=None):
        key = linear_kernels._key(x, weight, bias, out_dtype, add)
        return first(linear_kernels._CHOICE, key, linear_kernels.candidates(key[0], weight.shape[0], x.shape[1])[0])

    def norm(x, residual, norm_weight, eps, weight, bias=None, out_dtype=None):
        key = linear_norm._key(x, residual, norm_weight, weight, bias, out_dtype)
        return first(linear_norm._CHOICE, key, linear_kernels.candidates(key[0], weight.shape[0], x.shape[1])[0])

    def act(x, weight, bias=None, activation="silu", limit=None, add=None):
        key = linear_act._key(x, weight, bias, activation, limit, add)
        return first(linear_act._CHOICE, key, linear_kernels.candidates(key[0], *weight.shape)[0])

    def gated(x, norm_weight, gate, eps, weight, bias=None):
        key = linear_norm._gated_key(x, norm_weight, gate, weight, bias)
        block = linear_norm.gated_candidates(key[0], weight.shape[0], weight.shape[1], x.shape[2])[0]
        return first(linear_norm._GATED, key, block)

    def dual(x, weight, x2, weight2, activation=None, limit=None):
        key = linear_act._dual_key(x, weight, x2, weight2, activation, limit)
        return first(linear_act._DUAL, key, linear_act.dual_candidates(key[0], *weight.shape, weight2.shape[1])[0])

    def router(x, weight, bias, top_k, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1,
               norm_topk_prob=True, routed_scaling_factor=1.0):
        key = router_kernels._key(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob)
        return first(router_kernels._CHOICE, key, router_kernels.candidates(key[0], *weight.shape)[0])

    def gate(x, gate, weight, bias=None):
        key = linear_act._gate_key(x, gate, weight, bias)
        return first(linear_act._GATE, key, linear_kernels.candidates(key[0], *weight.shape)[0])

    for module, name, fn, choices in (
            (linear_kernels, "measured_choice", linear, "_CHOICE"), (linear_norm, "measured_choice", norm, "_CHOICE"),
            (linear_act, "measured_choice", act, "_CHOICE"), (linear_norm, "gated_choice", gated, "_GATED"),
            (linear_act, "dual_choice", dual, "_DUAL"), (router_kernels, "measured_choice", router, "_CHOICE"),
            (linear_act, "gate_choice", gate, "_GATE")):
        monkeypatch.setattr(module, name, fn)
        monkeypatch.setattr(module, choices, {})


@pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
def test_skinny_linears_and_the_ops_inside_them_give_the_reference_tokens(model_dir, monkeypatch, cuda_ops_on_cpu):
    """With the skinny kernel chosen for every linear of a few rows (as a GPU's timing may choose it), decode runs
    each layer's input norm inside its fused projection (rms_norm_linear), the MLPs' activations inside their down
    projections (act_linear), KDA's gated norm inside its output projection (rms_norm_gated_linear), a LatentMoE
    up-projection with its shared expert (dual_linear), the routing inside the routed experts' first kernel
    (moe_experts_routed; the router with its routing, moe_router, on longer steps), gated attention's output gate
    inside its output projection (sigmoid_gate_linear) and the plain linears through the kernel: the same greedy
    tokens as the reference engine, in fp32. (In fp32 the dense MLPs
    run the reference ``mlp``: act_linear's kernel runs here inside dual_linear, and alone in tests/ops.)"""
    choose_first_blocks(monkeypatch)
    routed_inside = []
    real = direct_kernels.moe_experts_routed
    monkeypatch.setattr(direct_kernels, "moe_experts_routed",
                        lambda *a, **kw: routed_inside.append(kw.get("early", False)) or real(*a, **kw))
    want, got, chosen = reference_and_device_tokens(model_dir, cuda_ops_on_cpu, 3, 8)
    assert ("linear", "cuda") in chosen
    called = {name for name, _ in chosen}
    for op in ("rms_norm_linear", "rms_norm_gated_linear", "dual_linear", "sigmoid_gate_linear"):
        if op in called:  # on its decode rows the kernel ran
            assert (op, "cuda") in chosen, (op, chosen)
    kernel_routes = ("moe_route", "reference") not in chosen  # softmax routing: no routing kernel takes it
    if "moe_experts_routed" in called and kernel_routes:  # decode rows routed inside the first expert kernel
        assert routed_inside, chosen
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("moe_latent_size"):  # a LatentMoE routes first: its logits are routed before the wait
            assert any(routed_inside)
    assert got == want
