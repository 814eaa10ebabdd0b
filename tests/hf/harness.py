"""Parity with transformers: build a tiny random model with transformers' own class, save it, load the
directory with dayzero, and compare prompt logits and greedy continuations in fp32.

Guards (each found when these references were first tried offline):
- fresh random weights leave norms at 1 and biases / correction biases / sinks at 0, so an engine that
  skips them would still match: every tensor whose values are all equal gets noise before saving;
- transformers picks fla / causal-conv1d / mamba-ssm kernels whenever they import, with no device check:
  those modules are blocked so the reference takes its pure-PyTorch path;
- near-ties at a greedy step make the token depend on rounding: comparison stops at the first step whose
  top-2 gap in the reference is below ``TIE``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from dayzero import LLM, SamplingParams
from dayzero.tools.align_hf import block_kernels
from tests.engine.test_incremental import run_chunks

TIE = 1e-4


@torch.no_grad()
def make_hf_checkpoint(path: Path, model_type: str, seed: int = 0, init=None, auto_class: str = "AutoModelForCausalLM",
                       **config):
    """A tiny random ``model_type`` model made by transformers (through ``auto_class``, e.g.
    ``AutoModelForImageTextToText`` for a vision-language model), saved to ``path``; returns the model (fp32).
    ``init(model)``, if given, runs on the fresh model before the noise (e.g. to move gates into a trained range)."""
    block_kernels()
    import pytest
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # the reference implementation is absent, so there is nothing to compare
        pytest.skip(f"transformers {transformers.__version__} has no {model_type} implementation")
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(model_type, **config)
    cfg._attn_implementation = "eager"
    model = getattr(transformers, auto_class).from_config(cfg, torch_dtype=torch.float32).eval()
    if init is not None:
        init(model)
    g = torch.Generator().manual_seed(seed + 1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.numel() > 1 and bool((t == t.flatten()[0]).all()) and "inv_freq" not in name:
            t.add_(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(str(path))
    return model


def prompt_batch(vocab: int, lengths=(5, 23, 12, 40), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def check_parity(path: Path, hf_model, prompts: list[list[int]], new_tokens: int = 16, rtol: float = 1e-4,
                 llm_kwargs: dict | None = None, hf_cache: bool = True) -> LLM:
    """(a) prompt logits within ``rtol`` relative of transformers' forward; (b) ``new_tokens`` greedy tokens
    through ``LLM.generate`` (all prompts in one batch) equal transformers' ``generate(do_sample=False)``
    (a full forward per token without ``hf_cache``). Returns the engine's ``LLM`` for further checks."""
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=512, max_num_batched_tokens=64,
              **(llm_kwargs or {}))
    for ids in prompts:
        ref = hf_model(torch.tensor([ids])).logits[0].float()
        ours = run_chunks(llm.engine, ids, [len(ids)])
        rel = ((ours - ref).norm() / ref.norm()).item()
        assert rel <= rtol, f"prompt of {len(ids)} tokens: logits relative error {rel:.2e} (max abs {(ours - ref).abs().max():.2e})"
        print(f"parity: prompt of {len(ids)} tokens, logits relative error {rel:.2e}")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        gen = hf_model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, use_cache=hf_cache,
                                output_scores=True, return_dict_in_generate=True)
        ref = gen.sequences[0, len(ids):].tolist()
        n = len(ref)
        for step, scores in enumerate(gen.scores):
            top2 = scores[0].float().topk(2).values
            if (top2[0] - top2[1]).item() < TIE:
                n = step + 1  # the reference's own choice at a tie is kept, later tokens may differ
                break
        assert n >= new_tokens // 2, f"reference has a near-tie after {n} tokens; pick another seed"
        assert out.outputs[0].token_ids[:n] == ref[:n], f"prompt of {len(ids)} tokens: ours {out.outputs[0].token_ids} vs transformers {ref}"
    return llm
