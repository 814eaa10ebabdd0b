"""The OpenAI API through the official client against a real server: completions and chat, streamed and
not, usage, n, logprobs, seeds, stop strings, unicode, models, health and metrics."""
from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, complete_ok

UNICODE = "héllo 你好 😀 e\u0301 👩\u200d👩\u200d👧 Ωμέγα"


def stream_completion(client, **kw):
    """(texts per choice, finish reasons per choice, usage, number of chunks)."""
    texts, reasons, usage, chunks = {}, {}, None, 0
    for c in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        chunks += 1
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return texts, reasons, usage, chunks


def stream_chat(client, **kw):
    """(deltas per choice, finish reasons per choice, usage)."""
    deltas, reasons, usage = {}, {}, None
    for c in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            if ch.delta.content:
                deltas.setdefault(ch.index, []).append(ch.delta.content)
            if ch.finish_reason:
                reasons[ch.index] = ch.finish_reason
    return deltas, reasons, usage


def test_health_models_and_metrics(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    m = server.metrics()
    for name in ("dayzero_requests_running", "dayzero_requests_waiting", "dayzero_cache_blocks_used",
                 "dayzero_cache_blocks_free", "dayzero_state_slots_used", "dayzero_state_slots_free",
                 "dayzero_prompt_tokens_total", "dayzero_generation_tokens_total", "dayzero_preemptions_total",
                 "dayzero_aborts_total", "dayzero_time_to_first_token_seconds_count",
                 "dayzero_time_per_output_token_seconds_count", "dayzero_e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["dayzero_cache_blocks_free"] == 2047 and m["dayzero_state_slots_free"] == 64


def test_completion_and_usage(server, client):
    before = server.metrics()
    r = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=7, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("The quick brown fox") and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    after = server.wait_idle()
    assert after["dayzero_generation_tokens_total"] - before["dayzero_generation_tokens_total"] == 7
    assert after["dayzero_prompt_tokens_total"] - before["dayzero_prompt_tokens_total"] == 19
    assert after["dayzero_time_to_first_token_seconds_count"] > before["dayzero_time_to_first_token_seconds_count"]
    # the CPU server runs every step eagerly: one prefill step and a decode step per token after the first
    steps = {k: after[k] - before.get(k, 0) for k in after if k.startswith("dayzero_model_steps_total{")}
    assert steps["dayzero_model_steps_total{kind=prefill,mode=eager}"] >= 1
    assert steps["dayzero_model_steps_total{kind=decode,mode=eager}"] == 6
    assert not any(v for k, v in steps.items() if "mode=graph" in k)
    # the bundled model's MoE layers count every routed (token, expert) pair: top-k per MoE layer for each of the
    # 25 tokens run (the prompt's 19, then 6 of the 7 sampled: the last is not fed back)
    routed = after["dayzero_ep_rank_routed_tokens_total{rank=0}"] - before["dayzero_ep_rank_routed_tokens_total{rank=0}"]
    per_expert = [after[k] - before.get(k, 0) for k in after if k.startswith("dayzero_expert_routed_tokens_total{")]
    assert routed > 0 and routed == sum(per_expert) and routed % 25 == 0
    assert all(v >= 1 for k, v in after.items() if k.startswith("dayzero_expert_load_imbalance{"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streamed_completion_equals_non_streamed(client, seed):
    kw = dict(prompt="Once upon a time", max_tokens=40, temperature=1.0, seed=seed, n=2)
    full = client.completions.create(**{"model": MODEL, **kw})
    texts, reasons, usage, _ = stream_completion(client, **kw)
    assert texts == {c.index: c.text for c in full.choices}
    assert reasons == {c.index: c.finish_reason for c in full.choices}
    assert usage.model_dump() == full.usage.model_dump()


@pytest.mark.parametrize("seed", [4, 5])
def test_streamed_chat_equals_non_streamed(client, seed):
    kw = dict(messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi " + UNICODE}],
              max_completion_tokens=40, temperature=1.0, seed=seed)
    full = client.chat.completions.create(model=MODEL, **kw)
    deltas, reasons, usage = stream_chat(client, **kw)
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert "".join(deltas.get(0, [])) == full.choices[0].message.content
    assert reasons[0] == full.choices[0].finish_reason
    assert usage.model_dump() == full.usage.model_dump()


def test_chat_usage_counts_the_templated_prompt(client):
    msgs = [{"role": "user", "content": UNICODE}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, extra_body={"ignore_eos": True})
    # byte-level tokenizer: <|bos|> <|user|> content bytes <|end|> <|assistant|>
    assert r.usage.prompt_tokens == 4 + len(UNICODE.encode())
    assert r.usage.completion_tokens == 3


def test_unicode_prompt_round_trips(client):
    r = client.completions.create(model=MODEL, prompt=UNICODE, max_tokens=2, echo=True, seed=0)
    assert r.choices[0].text.startswith(UNICODE)
    assert r.usage.prompt_tokens == len(UNICODE.encode())
    texts, _, _, _ = stream_completion(client, prompt=UNICODE, max_tokens=2, echo=True, seed=0)
    assert texts[0] == r.choices[0].text


def test_streamed_chunks_never_split_a_character(client):
    """Random weights over a byte vocabulary produce multi-byte characters, and broken ones; every streamed
    delta must be a piece of the final text cut between characters, so the pieces add up to it exactly."""
    multibyte = 0
    for seed in (0, 4, 8):  # twelve independent outputs (see test_samples_are_independent_of_other_seeds)
        kw = dict(prompt=UNICODE, max_tokens=64, n=4, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        full = {c.index: c.text for c in client.completions.create(model=MODEL, **kw).choices}
        pieces = {i: [] for i in full}
        for c in client.completions.create(model=MODEL, stream=True, **kw):
            for ch in c.choices:
                if ch.text:
                    pieces[ch.index].append(ch.text)
        for i, text in full.items():
            assert "".join(pieces[i]) == text
            # a piece that ended inside a character would show U+FFFD where the final text has the character
            assert sum(p.count("\ufffd") for p in pieces[i]) == text.count("\ufffd")
            multibyte += sum(1 for ch in text if ord(ch) > 0x7F and ch != "\ufffd")
    assert multibyte > 0, "no multi-byte character was generated: the test did not exercise the case"


def test_samples_are_independent_of_other_seeds(client):
    """Output i of a seeded request draws from (seed, i): output 1 of seed 42 is not output 0 of seed 43, and
    output 0 is the same draw whatever n is."""
    kw = dict(model=MODEL, prompt="seeds", max_tokens=24, temperature=1.0, extra_body={"ignore_eos": True})
    two = {c.index: c.text for c in client.completions.create(seed=42, n=2, **kw).choices}
    assert two[0] != two[1]
    assert two[1] != client.completions.create(seed=43, **kw).choices[0].text
    assert two[0] == client.completions.create(seed=42, **kw).choices[0].text


def test_stop_string_streamed_and_not(client):
    kw = dict(prompt="abc", max_tokens=48, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    free = client.completions.create(model=MODEL, **kw).choices[0].text
    # a stop string of two characters the output contains, including a multi-byte one if there is one
    at = next((i for i in range(4, len(free) - 1) if ord(free[i]) > 0x7F and free[i] != "\ufffd"), len(free) // 2)
    stop = free[at:at + 2]
    cut = client.completions.create(model=MODEL, stop=[stop, "\u2603never"], **kw).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and free.startswith(cut.text)
    texts, reasons, _, _ = stream_completion(client, stop=[stop, "\u2603never"], **kw)
    assert texts[0] == cut.text and reasons[0] == "stop"


def test_completion_logprobs_match_openai(client):
    """Completions logprobs as OpenAI sends them: top_logprobs best first, and text_offset the index in the
    returned text where each token starts (a byte of a multi-byte character: where that character starts)."""
    kw = dict(prompt=UNICODE, max_tokens=48, n=3, logprobs=3, temperature=1.0, seed=21, extra_body={"ignore_eos": True})
    full = client.completions.create(model=MODEL, **kw)
    multibyte = 0
    for c in full.choices:
        lp, text = c.logprobs, c.text
        for alts in lp.top_logprobs:
            values = list(alts.values())
            assert values == sorted(values, reverse=True)
        offsets = lp.text_offset
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
        for token, at in zip(lp.tokens, offsets):
            if token.startswith("bytes:"):
                multibyte += 1
            elif not (token.startswith("<|") and token.endswith("|>")):  # special tokens are not in the text
                assert text[at:at + len(token)] == token
    assert multibyte > 0, "no partial character was generated: the test did not exercise the case"
    streamed = {}
    for chunk in client.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            if ch.logprobs:
                streamed.setdefault(ch.index, []).extend(ch.logprobs.text_offset)
    assert streamed == {c.index: c.logprobs.text_offset for c in full.choices}


def test_n_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=5, n=3, logprobs=0, seed=7,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 15
    for c in r.choices:
        assert len(c.logprobs.token_logprobs) == 5 and all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert len(c.logprobs.tokens) == 5
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=0, seed=7, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(t.logprob <= 0 and isinstance(t.bytes, list) for t in content)
    # the tokens' bytes put together are the text's bytes (the byte-level model: one byte per token)
    assert bytes(b for t in content for b in t.bytes).decode("utf-8", "replace") == chat.choices[0].message.content
    # streamed logprobs: one entry per generated token
    got = []
    for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                            logprobs=True, seed=7, stream=True, extra_body={"ignore_eos": True}):
        for ch in c.choices:
            got += [t.logprob for t in (ch.logprobs.content if ch.logprobs else [])]
    assert got == pytest.approx([t.logprob for t in content])


def test_top_logprobs_are_the_most_likely_alternatives(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          logprobs=True, top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    for t in chat.choices[0].logprobs.content:
        alts = [a.logprob for a in t.top_logprobs]
        assert len(alts) == 3 and alts == sorted(alts, reverse=True)
        assert t.logprob == pytest.approx(alts[0], abs=1e-5)  # greedy picks the most likely token
        assert t.token == t.top_logprobs[0].token and all(isinstance(a.bytes, list) for a in t.top_logprobs)
    streamed = []
    for c in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                            logprobs=True, top_logprobs=3, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}):
        for ch in c.choices:
            streamed += [[a.logprob for a in t.top_logprobs] for t in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == [pytest.approx([a.logprob for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content]
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.top_logprobs) == 3
    for chosen, alts in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(alts) <= 2 and max(alts.values()) == pytest.approx(chosen, abs=1e-5)


def test_batch_of_prompts_and_token_ids(client):
    r = client.completions.create(model=MODEL, prompt=[[72, 105], [104, 101, 121]], max_tokens=3, n=2,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt=["a", "bb"], max_tokens=2, temperature=0, echo=True)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert texts[0].startswith("a") and texts[1].startswith("bb")


def test_greedy_is_the_same_alone_and_alongside_others(server, client):
    prompt = "determinism"
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    batch = client.completions.create(model=MODEL, prompt=["other prompt", prompt, "a third one!"], max_tokens=24,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert next(c.text for c in batch.choices if c.index == 1) == alone
    server.wait_idle()


def test_api_key_is_required_except_on_health(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-0123456789"}):
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(server.url + path, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", r.text
        r = httpx.post(server.url + "/v1/completions", headers=headers, json={"prompt": "x"})
        assert r.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    complete_ok(server)
