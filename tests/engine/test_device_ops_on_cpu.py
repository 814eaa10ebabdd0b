"""The engine with the device (``cuda``) implementations of every op chosen as on a GPU, their verifiers
included, but run on CPU tensors: greedy tokens equal the reference engine's, in fp32, for each family whose
decode runs through the batch-wide ops. This checks the device decode path in CI, where no GPU exists."""
from __future__ import annotations


import pytest

from dayzero import LLM, SamplingParams
from dayzero.ops import registry, triton_support
from dayzero.ops.linear import kernels as linear_kernels, norm as linear_norm
from tests.engine.families import prompts


KW = dict(device="cpu", dtype="float32", load_format="dummy", block_size=4, num_cache_blocks=256, max_num_seqs=8,
          max_model_len=128)


def reference_and_device_tokens(model_dir, monkeypatch, n: int, max_tokens: int):
    """Greedy tokens of ``n`` prompts from the reference engine and from one choosing the device implementations,
    and the (op, implementation) pairs the device run called."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref_llm = LLM(model_dir, **KW)
    ps = prompts(n, ref_llm.engine.model_config.vocab_size, 2)
    want = [o.outputs[0].token_ids for o in ref_llm.generate(ps, sp)]
    chosen = set()
    hook = lambda op, c, reason, fn, args, kwargs: chosen.add((op, c)) or fn(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(registry, "platform_of", lambda device: "cuda")
    prev = registry.set_hook(hook)
    try:
        got = [o.outputs[0].token_ids for o in LLM(model_dir, **KW).generate(ps, sp)]
    finally:
        registry.set_hook(prev)
    return want, got, chosen


def test_device_implementations_give_the_reference_tokens(model_dir, monkeypatch):
    want, got, chosen = reference_and_device_tokens(model_dir, monkeypatch, 5, 24)
    assert any(c == "cuda" for _, c in chosen), chosen  # the device decode paths did run
    assert got == want


def test_device_implementations_run_in_bf16(model_dir, monkeypatch):
    """bf16 through the device paths (dtypes of states, rings, pools and outputs agree)."""
    monkeypatch.setattr(registry, "platform_of", lambda device: "cuda")
    llm = LLM(model_dir, device="cpu", dtype="bfloat16", load_format="dummy", block_size=4, num_cache_blocks=256,
              max_num_seqs=8, max_model_len=128)
    outs = llm.generate(prompts(3, llm.engine.model_config.vocab_size, 4),
                        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


@pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
def test_skinny_linears_and_the_norm_inside_them_give_the_reference_tokens(model_dir, monkeypatch):
    """With the skinny kernel chosen for every linear of a few rows (as a GPU's timing may choose it), decode runs
    each layer's input norm inside its fused projection (rms_norm_linear) and the plain linears through the
    kernel: the same greedy tokens as the reference engine, in fp32."""
    def first_block(x, weight, bias=None, out_dtype=None, add=None):
        key = linear_kernels._key(x, weight, bias, out_dtype, add)
        linear_kernels._CHOICE[key] = linear_kernels.candidates(key[0], weight.shape[0], x.shape[1])[0]
        return linear_kernels._CHOICE[key]

    def norm_first_block(x, residual, norm_weight, eps, weight, bias=None):
        key = linear_norm._key(x, residual, norm_weight, weight, bias)
        linear_norm._CHOICE[key] = linear_kernels.candidates(key[0], weight.shape[0], x.shape[1])[0]
        return linear_norm._CHOICE[key]

    monkeypatch.setattr(linear_kernels, "measured_choice", first_block)
    monkeypatch.setattr(linear_kernels, "_CHOICE", {})
    monkeypatch.setattr(linear_norm, "measured_choice", norm_first_block)
    monkeypatch.setattr(linear_norm, "_CHOICE", {})
    want, got, chosen = reference_and_device_tokens(model_dir, monkeypatch, 3, 8)
    assert ("linear", "cuda") in chosen
    if any(op == "rms_norm_linear" for op, _ in chosen):  # a family whose mixers take the fused projection
        assert ("rms_norm_linear", "cuda") in chosen, chosen  # decode rows' norms ran inside the kernel
    assert got == want
