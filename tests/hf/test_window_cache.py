"""Sliding-window layers free their blocks as they leave the window, and the outputs stay transformers'.

mixtral with a sliding window has only windowed layers: its one block table frees, and a pool of 11 blocks
(44 tokens) runs sequences of 64. gpt_oss mixes windowed and full layers: the windowed ones get a pool of
their own and hold a few blocks per sequence while the full layers hold every block. Greedy tokens and their
log-probabilities are checked against transformers' no-cache forward on the same tiny random checkpoint.
"""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.server.metrics import _EngineCollector
from tests.hf.harness import TIE, make_hf_checkpoint, prompt_batch
from tests.hf.test_gpt_oss import CONFIG as GPT_OSS
from tests.hf.test_moe_families import COMMON, FAMILIES

NEW = 24


@torch.no_grad()
def _reference(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by a full forward per token, up to the first near-tie, with their log-probabilities."""
    seq, logps = list(ids), []
    for _ in range(n):
        logits = hf(torch.tensor([seq])).logits[0, -1].float()
        top2 = logits.topk(2)
        tok = int(top2.indices[0])
        logps.append(torch.log_softmax(logits, -1)[tok].item())
        seq.append(tok)
        if (top2.values[0] - top2.values[1]).item() < TIE:
            break
    return seq[len(ids):], logps


def _check(llm: LLM, hf, prompts: list[list[int]]) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    for ids, out in zip(prompts, outs):
        ref, ref_lp = _reference(hf, ids, NEW)
        assert len(ref) >= NEW // 2, "the reference has a near-tie early; pick another seed"
        got = out.outputs[0]
        assert got.token_ids[:len(ref)] == ref, f"prompt of {len(ids)} tokens"
        assert max(abs(a - b) for a, b in zip(got.logprobs, ref_lp)) < 1e-4


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_window")
    return path, make_hf_checkpoint(path, "mixtral", **COMMON, **FAMILIES["mixtral"], sliding_window=8)


def test_windowed_model_runs_sequences_longer_than_its_cache(mixtral):
    path, hf = mixtral
    prompts = prompt_batch(COMMON["vocab_size"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=12, max_num_batched_tokens=16,
              max_num_seqs=4)
    plan = llm.engine.cache_plan
    assert plan.window == 8 and (plan.num_blocks - 1) * 4 < max(map(len, prompts)) + NEW
    _check(llm, hf, prompts)
    assert llm.engine.cache.blocks.num_used == 0  # every block back (cached ones evictable)
    with torch.no_grad():  # the window matters on these prompts
        ids = torch.tensor([max(prompts, key=len)])
        windowed = hf(ids).logits
        hf.config.sliding_window = None
        try:
            assert not torch.allclose(hf(ids).logits, windowed, atol=1e-3)
        finally:
            hf.config.sliding_window = 8


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_window")
    return path, make_hf_checkpoint(path, "gpt_oss", **GPT_OSS)


def test_mixed_model_keeps_a_window_pool_of_few_blocks(gpt_oss):
    path, hf = gpt_oss
    prompts = prompt_batch(GPT_OSS["vocab_size"])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=4, num_cache_blocks=96, max_num_batched_tokens=16,
              max_num_seqs=4)
    eng = llm.engine
    assert eng.cache_plan.window is None and eng.cache_plan.window_pool[0] == GPT_OSS["sliding_window"]
    full, windowed = (pool for pool, _ in eng.cache.groups)
    peaks = {"full": 0, "window": 0}
    step = eng.step

    def counted():
        out = step()
        peaks["full"] = max(peaks["full"], full.num_used)
        peaks["window"] = max(peaks["window"], windowed.num_used)
        return out

    eng.step = counted
    _check(llm, hf, prompts)
    # four sequences of up to 64 tokens: the full layers' blocks grow with them, the windowed ones' do not
    assert peaks["full"] >= 16 and peaks["window"] < peaks["full"] // 2
    assert full.num_used == 0 and windowed.num_used == 0
    usage = eng.cache.usage()
    assert usage["window_blocks_total"] == eng.cache_plan.window_pool[1] - 1
    metrics = {m.name: m.samples[0].value for m in _EngineCollector(eng.stats, lambda: 0).collect() if m.samples}
    assert metrics["dayzero_cache_window_blocks_used"] == 0
    assert metrics["dayzero_cache_window_blocks_free"] == usage["window_blocks_total"]
