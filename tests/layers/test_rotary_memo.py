"""One cos/sin per forward pass for every rotary of the same frequencies (the MLA and indexer rotaries of all
layers), computed again for the next pass: the memo never carries a step's angles into another step."""
from __future__ import annotations

import torch

from dayzero import LLM, SamplingParams
from dayzero.layers.rotary import RotaryEmbedding


def test_cos_sin_is_computed_once_per_forward_and_never_reused_across_steps(tiny_ckpt, monkeypatch):
    calls = []
    real = RotaryEmbedding.cos_sin

    def counted(self, positions):
        calls.append((self.key, positions.tolist()))
        return real(self, positions)

    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 20))}
    want = LLM(str(tiny_ckpt), dtype="float32").generate([prompt], sp)[0].outputs[0].token_ids
    llm = LLM(str(tiny_ckpt), dtype="float32")
    rotaries = [m for m in llm.engine.model.modules() if isinstance(m, RotaryEmbedding)]
    keys = {m.key for m in rotaries}
    assert len(rotaries) > len(keys)  # the tiny model has rotaries that share their frequencies
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", counted)
    got = llm.generate([prompt], sp)[0].outputs[0].token_ids
    assert got == want
    # per frequency set, each forward pass's positions once: together every position fed, 0..16 of the prompt
    # (however the prefill is chunked) and 17..19 of the decode steps
    for key in keys:
        fed = [p for k, pos in calls if k == key for p in pos]
        assert fed == list(range(20))
    assert len(calls) % len(keys) == 0
