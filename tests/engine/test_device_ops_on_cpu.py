"""The engine with the device (``cuda``) implementations of every op chosen as on a GPU, their verifiers
included, but run on CPU tensors: greedy tokens equal the reference engine's, in fp32, for each family whose
decode runs through the batch-wide ops. This checks the device decode path in CI, where no GPU exists."""
from __future__ import annotations


from dayzero import LLM, SamplingParams
from dayzero.ops import registry
from tests.engine.families import prompts


def test_device_implementations_give_the_reference_tokens(model_dir, monkeypatch):
    kw = dict(device="cpu", dtype="float32", load_format="dummy", block_size=4, num_cache_blocks=256, max_num_seqs=8,
              max_model_len=128)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref_llm = LLM(model_dir, **kw)
    ps = prompts(5, ref_llm.engine.model_config.vocab_size, 2)
    want = [o.outputs[0].token_ids for o in ref_llm.generate(ps, sp)]
    chosen = set()
    hook = lambda op, c, reason, fn, args, kwargs: chosen.add((op, c)) or fn(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(registry, "platform_of", lambda device: "cuda")
    prev = registry.set_hook(hook)
    try:
        got = [o.outputs[0].token_ids for o in LLM(model_dir, **kw).generate(ps, sp)]
    finally:
        registry.set_hook(prev)
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
