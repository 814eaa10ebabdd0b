"""Prefix caching through the engine: a request that shares a prefix with an earlier one reuses its cached
blocks (and, for models with per-sequence states, the states snapshotted at the last point at or before the
shared prefix) and gives exactly the output it gives without the cache: the same greedy tokens and the same
log-probabilities within 1e-5, whatever the shared length (on, before and after block boundaries and snapshot
points), with preemption and aborts in between; every block, slot and snapshot is accounted for afterwards."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.engine.families import hf_config

FAMILIES = ["dayzero_hybrid", "kimi_linear", "qwen3_next", "nemotron_h", "deepseek_v32", "deepseek_v4", "gpt_oss"]
BS, INTERVAL = 4, 8  # small blocks and snapshot points, so short prompts cross many of both
# a step's budget that reaches one snapshot point at a time (a chunk stops at the last point it reaches), with
# room for a second sequence's chunk in the same step
BUDGET = INTERVAL + 4


@pytest.fixture(params=FAMILIES)
def family(request, tmp_path, tiny_ckpt):
    if request.param == "dayzero_hybrid":
        return str(tiny_ckpt)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(request.param)))
    return str(tmp_path)


def llm(path: str, cached: bool, **kw) -> LLM:
    kw = {"num_cache_blocks": 128, "prefix_snapshot_interval": INTERVAL, "max_num_batched_tokens": BUDGET, **kw}
    return LLM(path, device="cpu", dtype="float32", load_format="dummy", block_size=BS, max_num_seqs=4,
               max_model_len=128, enable_prefix_caching=cached, **kw)


def tokens(vocab: int, n: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def outputs(engine: LLM, prompts: list[list[int]], max_tokens: int = 8):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.outputs[0].top_logprobs) for o in outs]


def assert_same(got, want):
    for (gt, gl, gtop), (wt, wl, wtop) in zip(got, want):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), rtol=1e-5, atol=1e-5)
        for a, b in zip(gtop, wtop):
            assert [i for i, _ in a] == [i for i, _ in b]
            torch.testing.assert_close(torch.tensor([v for _, v in a]), torch.tensor([v for _, v in b]),
                                       rtol=1e-5, atol=1e-5)


def assert_all_free(engine: LLM):
    u = engine.engine.cache_usage()
    assert u["blocks_free"] == u["blocks_total"] and u["slots_free"] == u["slots_total"], u
    assert u["snapshots"] <= engine.engine.cache_plan.num_snapshots


# shared prefix lengths: before / on / after block boundaries (4) and snapshot points (8)
SHARED = [3, 4, 7, 8, 9, 15, 16, 17, 23, 24, 30]


def test_a_hit_gives_the_uncached_output(family):
    cached, plain = llm(family, True), llm(family, False)
    vocab = cached.engine.model_config.vocab_size
    base = tokens(vocab, 40, 1)
    first = [base[:31]]  # the earlier request: its prompt's blocks and snapshots go into the cache
    followers = [base[:n] + tokens(vocab, 6, 100 + n) for n in SHARED]
    assert_same(outputs(cached, first), outputs(plain, first))
    for prompt in followers:  # one at a time: each finds the first request's (and earlier followers') prefix
        assert_same(outputs(cached, [prompt]), outputs(plain, [prompt]))
    stats = cached.engine.stats()
    assert stats["prefix_hit_tokens"] > 0, stats
    assert_all_free(cached)


def test_the_same_prompt_again_computes_only_its_last_tokens(tiny_ckpt):
    engine = llm(str(tiny_ckpt), True)
    prompt = tokens(engine.engine.model_config.vocab_size, 37, 2)
    first = outputs(engine, [prompt])
    before = engine.engine.cache.hit_tokens
    assert outputs(engine, [prompt]) == first
    # 37 tokens: the last aligned point at or before 36 with a snapshot is 32 (every 8, and the prompt's 36)
    assert engine.engine.cache.hit_tokens - before == 36
    assert_all_free(engine)


def test_whole_budget_steps_snapshot_where_they_end(tiny_ckpt):
    """With a budget of 20 tokens a 61-token prompt takes 5 steps, not one per interval (8): chunks stop at the
    last snapshot point they reach (16, 32, 48) and at the prompt's aligned end (60); a later prompt resumes from
    the last of those at or before its shared prefix, with the uncached output."""
    cached, plain = (llm(str(tiny_ckpt), c, max_num_batched_tokens=20, num_prefix_snapshots=8) for c in (True, False))
    vocab = cached.engine.model_config.vocab_size
    base = tokens(vocab, 70, 6)
    eng = cached.engine
    eng.add_request("first", base[:61], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seq, ends = eng.scheduler.waiting[-1], []
    while eng.has_unfinished():
        eng.step()
        ends.append(seq.num_computed)
    assert ends[:5] == [16, 32, 48, 60, 61]
    for shared, hit in ((20, 16), (47, 32), (61, 60)):
        before = eng.cache.hit_tokens
        prompt = base[:shared] + tokens(vocab, 5, 200 + shared)
        assert_same(outputs(cached, [prompt]), outputs(plain, [prompt]))
        assert eng.cache.hit_tokens - before == hit, (shared, eng.cache.hit_tokens - before)
    assert_all_free(cached)


def test_preemption_and_aborts_between_hits(family):
    """A cache too small for all at once: sequences are preempted and re-admitted (finding their own prefix),
    others aborted, and every output still equals the uncached engine's under the same pressure."""
    kw = {"num_cache_blocks": 28}
    cached, plain = llm(family, True, **kw), llm(family, False, **kw)
    vocab = cached.engine.model_config.vocab_size
    shared = tokens(vocab, 20, 3)
    prompts = [shared + tokens(vocab, k, 10 + k) for k in (1, 5, 9, 2)]
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for e in (cached, plain):
        eng = e.engine
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, sp)
        eng.add_request("gone", prompts[0], sp)
        eng.step()
        eng.abort("gone")
    results = []
    for e in (cached, plain):
        done, eng = {}, e.engine
        while eng.has_unfinished():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        results.append(done)
        assert_all_free(e)
    assert results[0] == results[1]
    assert cached.engine.scheduler.num_preemptions > 0 and cached.engine.cache.hit_tokens > 0


def test_off_computes_everything(tiny_ckpt):
    engine = llm(str(tiny_ckpt), False)
    prompt = tokens(engine.engine.model_config.vocab_size, 21, 4)
    outputs(engine, [prompt])
    outputs(engine, [prompt])
    assert engine.engine.cache.hit_tokens == 0 and engine.engine.cache_usage()["blocks_cached"] == 0


def test_samples_of_one_request_share_the_prompt(family):
    """n = 4: the later samples start once the first has computed the prompt and take it from the cache; every
    sample's tokens are those of the uncached engine (seeded sampling: each sample's own generator)."""
    cached, plain = llm(family, True), llm(family, False)
    prompt = tokens(cached.engine.model_config.vocab_size, 26, 5)
    sp = SamplingParams(n=4, max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    got = [c.token_ids for c in cached.generate([{"prompt_token_ids": prompt}], sp)[0].outputs]
    want = [c.token_ids for c in plain.generate([{"prompt_token_ids": prompt}], sp)[0].outputs]
    assert got == want
    # each later sample reuses the prompt up to its last snapshot point (or block, without states)
    assert cached.engine.cache.hit_tokens >= 3 * 16, cached.engine.stats()
    assert_all_free(cached)
