"""Overlapped steps (``async_scheduling``): the next step is queued before the host reads the previous step's
samples, and the outputs are exactly those of the engine that waits every step: greedy and seeded sampling
with logprobs, penalties (which make the host read first), EOS and stop strings, ``n > 1``, prefix-cache hits
with state snapshots, preemption under a tight cache, aborts and non-finite logits while a step is in flight;
every block and slot comes back."""
from __future__ import annotations

import pytest

from dayzero import LLM, SamplingParams
from dayzero.engine import sampler as sampler_mod
from tests.engine.test_engine import assert_cache_empty, prompts

PARAMS = {
    "greedy": SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
    "seeded-logprobs": SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=5, logprobs=3),
    "penalties": SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3),
    "stop-strings": SamplingParams(max_tokens=30, temperature=0.8, seed=2, stop=["e", "a "]),
    "n3": SamplingParams(max_tokens=10, temperature=1.0, seed=9, n=3),
}


def make(ckpt, overlap: bool, **kw) -> LLM:
    kw.setdefault("num_cache_blocks", 256)
    return LLM(str(ckpt), device="cpu", dtype="float32", block_size=4, async_scheduling=overlap, **kw)


def outputs(llm: LLM, ps, sp) -> list:
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs, c.top_logprobs) for c in o.outputs]
            for o in llm.generate(ps, sp)]


@pytest.mark.parametrize("name", list(PARAMS))
def test_same_outputs_as_the_waiting_engine(tiny_ckpt, name):
    ps, sp = prompts(8), PARAMS[name]
    sync, overlap = make(tiny_ckpt, False), make(tiny_ckpt, True)
    want = outputs(sync, ps, sp)
    assert outputs(overlap, ps, sp) == want
    assert_cache_empty(overlap)
    assert overlap.engine._inflight is None


def test_a_stop_token_found_one_step_late_changes_nothing(tiny_ckpt):
    """A sequence that stops on a token has run one more step by the time the host sees it: that row is
    discarded. A token the greedy outputs reach at different points stops some early, others run to the limit."""
    ps = prompts(8)
    free = outputs(make(tiny_ckpt, False), ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    stop = free[0][0][0][4]
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    want = outputs(make(tiny_ckpt, False), ps, sp)
    assert {o[0][2] for o in want} == {"stop", "length"}
    overlap = make(tiny_ckpt, True)
    assert outputs(overlap, ps, sp) == want
    assert_cache_empty(overlap)


def test_the_host_reads_a_step_after_queueing_the_next(tiny_ckpt, monkeypatch):
    llm = make(tiny_ckpt, True)
    eng, events = llm.engine, []
    real_execute, real_result = eng.runner.execute, sampler_mod.PendingSample.result
    monkeypatch.setattr(eng.runner, "execute", lambda batch: (events.append("queue"), real_execute(batch))[1])
    monkeypatch.setattr(sampler_mod.PendingSample, "result", lambda self: (events.append("read"), real_result(self))[1])
    eng.add_request("r", prompts(1)[0]["prompt_token_ids"], SamplingParams(max_tokens=4, ignore_eos=True))
    first = eng.step()
    assert first == [] and eng._inflight is not None  # the prefill's sample is still on its way
    q = eng.requests["r"][0]
    assert q.num_pending == 1 and q.output_ids == []
    while eng.has_unfinished():
        eng.step()
    assert events == ["queue", "queue", "read", "queue", "read", "queue", "read", "read"]
    assert_cache_empty(llm)


def test_prefix_hits_with_snapshots_give_the_same_outputs(tiny_ckpt):
    """Two turns: the second prompts extend the first turn's prompts and outputs, so they hit the prefix cache and
    resume the KDA states from snapshots (taken every 8 tokens here)."""
    sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    turn1 = prompts(6, seed=3)
    results = []
    for overlap in (False, True):
        llm = make(tiny_ckpt, overlap, prefix_snapshot_interval=8)
        first = llm.generate(turn1, sp)
        turn2 = [{"prompt_token_ids": p["prompt_token_ids"] + o.outputs[0].token_ids + [7, 8, 9]}
                 for p, o in zip(turn1, first)]
        results.append((outputs(llm, turn2, sp), llm.engine.cache_usage()))
        assert_cache_empty(llm)
    (want, u_sync), (got, u_async) = results
    assert got == want
    assert u_async["prefix_hit_tokens"] == u_sync["prefix_hit_tokens"] > 0
    assert u_async["snapshots"] == u_sync["snapshots"] > 0


def test_preemption_under_a_tight_cache(tiny_ckpt):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    want = outputs(make(tiny_ckpt, False, num_cache_blocks=24), prompts(8), sp)
    tight = make(tiny_ckpt, True, num_cache_blocks=24)
    assert outputs(tight, prompts(8), sp) == want
    assert tight.engine.scheduler.num_preemptions > 0
    assert_cache_empty(tight)


def test_abort_while_a_step_is_in_flight(tiny_ckpt):
    llm = make(tiny_ckpt, True)
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(f"a{i}", p["prompt_token_ids"], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    for i in range(4):
        assert eng.abort(f"a{i}")
    assert_cache_empty(llm)
    assert eng.step() == []  # the in-flight samples belong to aborted requests: read and dropped
    assert not eng.has_unfinished()
    sp = PARAMS["greedy"]
    assert outputs(llm, prompts(3), sp) == outputs(make(tiny_ckpt, False), prompts(3), sp)


def test_nan_logits_in_flight_end_only_that_request(tiny_ckpt, monkeypatch):
    """The device's -1 for a row with non-finite logits is the next step's input before the host sees it: it
    reads token 0 there, and the request then ends with an error; the other request is unaffected."""
    llm = make(tiny_ckpt, True)
    eng = llm.engine
    real, calls = eng.runner.execute, []

    def poisoned(batch):
        logits = real(batch).clone()
        if not calls:
            logits[0] = float("nan")
        calls.append(1)
        return logits

    monkeypatch.setattr(eng.runner, "execute", poisoned)
    outs = llm.generate(prompts(2), PARAMS["greedy"])
    monkeypatch.undo()
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    want = outputs(make(tiny_ckpt, False), prompts(2)[1:], PARAMS["greedy"])
    assert [[(c.token_ids, c.finish_reason) for c in outs[1].outputs]] == [[(w[0], w[2]) for w in want[0]]]
    assert_cache_empty(llm)


def test_delta_outputs_never_show_a_pending_token(tiny_ckpt):
    llm = make(tiny_ckpt, True)
    eng = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts(3)):
        eng.add_request(f"d{i}", p["prompt_token_ids"], sp, delta=True)
    got = {f"d{i}": [] for i in range(3)}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.outputs[0].token_ids if out.outputs else []
        for seqs in eng.requests.values():
            assert all(q.num_pending <= 1 for q in seqs)
    want = outputs(make(tiny_ckpt, False), prompts(3), sp)
    assert [got[f"d{i}"] for i in range(3)] == [w[0][0] for w in want]
    assert all(-1 not in ids for ids in got.values())
