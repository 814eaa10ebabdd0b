"""Engine behaviour through the public API: batch invariance (test 5), preemption (test 6), request
validation (test 7), aborts, cache sizing and faults from RELIABILITY.md."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.cache.planner import CacheMemoryError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int = 8, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 9, 30, 1, 12, 25, 6][:n]
    return [{"prompt_token_ids": torch.randint(0, 256, (L,), generator=g).tolist()} for L in lengths]


def greedy_ids(llm: LLM, ps, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(ps, params)]


def assert_cache_empty(llm: LLM) -> None:
    u = llm.engine.cache_usage()
    assert u["blocks_free"] == u["blocks_total"] and u["slots_free"] == u["slots_total"], u
    assert not llm.engine.scheduler.running and not llm.engine.scheduler.waiting


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=256)


def test_batch_invariance(tiny_ckpt, llm):
    ps = prompts()
    alone = [greedy_ids(llm, [p])[0] for p in ps]
    assert greedy_ids(llm, ps) == alone
    small_budget = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=256, max_num_batched_tokens=16)
    assert greedy_ids(small_budget, ps) == alone
    big_budget = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=256, max_num_batched_tokens=4096)
    assert greedy_ids(big_budget, ps) == alone
    assert_cache_empty(llm)


def test_preemption_keeps_outputs_and_returns_every_block(tiny_ckpt, llm):
    ps = prompts()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    reference = greedy_ids(llm, ps, params)
    # 8 sequences of up to 46 tokens need up to 12 blocks of 4 each: 24 blocks force preemption
    tight = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=24)
    assert greedy_ids(tight, ps, params) == reference
    assert tight.engine.scheduler.num_preemptions > 0
    assert_cache_empty(tight)


def test_seeded_sampling_is_reproducible_alone_and_in_batch(llm):
    ps = prompts(4)
    sp = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
    alone = greedy_ids(llm, [ps[1]], sp)[0]
    again = greedy_ids(llm, [ps[1]], sp)[0]
    batched = greedy_ids(llm, ps, [SamplingParams(max_tokens=10, temperature=0.7, seed=9, ignore_eos=True), sp, sp,
                                   SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)])
    assert alone == again == batched[1]
    other_seed = greedy_ids(llm, [ps[1]], SamplingParams(max_tokens=10, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed != alone


def test_n_logprobs_and_max_tokens(llm):
    out = llm.generate([prompts(1)[0]], SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=7, logprobs=0, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for o in out.outputs:
        assert len(o.token_ids) == 5 and o.finish_reason == "length"
        assert len(o.logprobs) == 5 and all(lp <= 0 for lp in o.logprobs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all(o.top_logprobs == [[]] * 5 for o in out.outputs)  # logprobs=0: the chosen token's only
    top = llm.generate([prompts(1)[0]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True))[0].outputs[0]
    for tok, lp, alts in zip(top.token_ids, top.logprobs, top.top_logprobs):
        assert len(alts) == 3 and alts[0] == (tok, pytest.approx(lp, abs=1e-5))  # greedy = the best alternative


def test_greedy_logprobs_match_full_forward(llm):
    """The chosen tokens' logprobs equal log_softmax of a fresh forward over prompt + output."""
    p = prompts(1)[0]
    o = llm.generate([p], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0, ignore_eos=True))[0].outputs[0]
    o2 = llm.generate([{"prompt_token_ids": p["prompt_token_ids"] + o.token_ids[:2]}],
                      SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, ignore_eos=True))[0].outputs[0]
    assert o2.token_ids[0] == o.token_ids[2]
    assert o2.logprobs[0] == pytest.approx(o.logprobs[2], abs=1e-4)


def test_stop_token_ids_and_stop_strings(llm):
    p = prompts(1)[0]
    free = llm.generate([p], GREEDY)[0].outputs[0]
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1] and out.stop_reason == stop_id
    text = llm.tokenizer.decode(free.token_ids)
    stop = next(c for c in text[2:] if c.strip())  # a character the output contains
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and stop not in out.text and text.startswith(out.text)


def test_eos_ends_generation_unless_ignored(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=64)
    p = prompts(1)[0]
    free = llm.generate([p], GREEDY)[0].outputs[0]
    llm.engine.eos_ids = (free.token_ids[2],)
    first = free.token_ids.index(free.token_ids[2])
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: first + 1]
    out = llm.generate([p], SamplingParams(max_tokens=12, temperature=0.0, min_tokens=first + 2))[0].outputs[0]
    assert len(out.token_ids) > first + 1
    assert llm.generate([p], GREEDY)[0].outputs[0].token_ids == free.token_ids


def test_text_prompts_and_chat(llm):
    out = llm.generate(["héllo 你好 😀"], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert out.prompt == "héllo 你好 😀"
    assert llm.tokenizer.decode(out.prompt_token_ids) == "héllo 你好 😀"
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.prompt == expected and len(chat.outputs[0].token_ids) == 3


def test_checkpoint_without_tokenizer_runs_on_token_ids(tiny_ckpt_no_tokenizer):
    llm = LLM(str(tiny_ckpt_no_tokenizer), device="cpu", dtype="float32", num_cache_blocks=64)
    assert llm.tokenizer is None
    out = llm.generate([{"prompt_token_ids": [1, 17, 42]}], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["text"], GREEDY)


# --- bad requests (test 7 and RELIABILITY.md) -----------------------------------------------------------
def test_prompt_longer_than_context_is_rejected_with_length_and_limit(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", max_model_len=64, num_cache_blocks=64)
    with pytest.raises(ValueError, match=r"prompt has 80 tokens.*64"):
        llm.generate([{"prompt_token_ids": [5] * 80}], GREEDY)
    with pytest.raises(ValueError, match=r"prompt has 60 tokens, max_tokens 12, context length 64"):
        llm.generate([{"prompt_token_ids": [5] * 60}], GREEDY)
    # omitted max_tokens means the rest of the context
    out = llm.generate([{"prompt_token_ids": [5] * 60}], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    assert_cache_empty(llm)


@pytest.mark.parametrize("bad,match", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, -3]}, "token ids"),
    ({"prompt_token_ids": [1, 10**6]}, "token ids"),
    (42, "prompt must be"),
], ids=["empty", "negative-id", "id-outside-vocab", "not-a-prompt"])
def test_bad_prompts_raise_and_leave_engine_clean(llm, bad, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompts(1)[0], bad], GREEDY)
    assert_cache_empty(llm)
    assert len(llm.generate([prompts(1)[0]], GREEDY)[0].outputs[0].token_ids) == 12


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0), ("top_k", 0), ("n", 0)])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_request_larger_than_whole_cache_is_rejected(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=5)  # 16 tokens
    with pytest.raises(ValueError, match="whole cache holds 16"):
        llm.generate([{"prompt_token_ids": [3] * 10}], SamplingParams(max_tokens=10))
    fits = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert len(llm.generate([{"prompt_token_ids": [3] * 6}], fits)[0].outputs[0].token_ids) == 8
    assert_cache_empty(llm)


def test_not_enough_memory_names_needed_available_and_setting(tiny_ckpt):
    with pytest.raises(CacheMemoryError, match=r"needs .*bytes.*available.*max_model_len"):
        LLM(str(tiny_ckpt), device="cpu", dtype="float32", cache_memory_bytes=10_000)


def test_pool_sized_from_memory_budget(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", cache_memory_bytes=8 << 20, max_num_seqs=4, block_size=16)
    plan = llm.engine.cache_plan
    assert plan.total_bytes <= 8 << 20
    assert plan.num_slots == 4 and plan.capacity_tokens >= llm.engine.max_model_len


def test_abort_of_queued_and_running_requests_frees_cache(llm):
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(f"abort-{i}", p["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.scheduler.running
    for i in range(4):
        assert eng.abort(f"abort-{i}")
    assert not eng.abort("abort-0")
    assert_cache_empty(llm)
    assert len(greedy_ids(llm, prompts(2))[1]) == 12


def test_nan_logits_end_only_that_request(llm, monkeypatch):
    eng = llm.engine
    real = eng.runner.execute

    calls = []

    def poisoned(batch):
        logits = real(batch).clone()
        if not calls:  # the first step samples both prompts; poison the first one's row
            logits[0] = float("nan")
        calls.append(1)
        return logits

    ps = prompts(2)
    monkeypatch.setattr(eng.runner, "execute", poisoned)
    outs = llm.generate(ps, GREEDY)
    monkeypatch.undo()
    assert outs[0].outputs[0].finish_reason == "error"
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 12
    assert_cache_empty(llm)
