"""Every bad input of RELIABILITY.md that applies to a text model, sent as raw HTTP (the official client
would refuse to send most of them). Each gets the right status and an OpenAI-shaped error that names
what was wrong; afterwards a valid request succeeds and every cache block and state slot is free."""
from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, complete_ok

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 4, **kw}


def image_part(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


# (path, body, status, text the message must contain, param)
CASES = {
    # sampling values out of range
    "max_tokens-0": (COMPLETIONS, completion(max_tokens=0), 400, "max_tokens must be an int >= 1", "max_tokens"),
    "max_tokens-negative": (CHAT, chat(max_tokens=-5), 400, "max_tokens", "max_tokens"),
    "max_completion_tokens-0": (CHAT, chat(max_completion_tokens=0), 400, "max_tokens", "max_tokens"),
    "min_tokens-negative": (COMPLETIONS, completion(min_tokens=-1), 400, "min_tokens", "min_tokens"),
    "min_tokens-above-max": (COMPLETIONS, completion(min_tokens=9, max_tokens=4), 400, "min_tokens must be <= max_tokens", "min_tokens"),
    "temperature-negative": (COMPLETIONS, completion(temperature=-0.5), 400, "temperature", "temperature"),
    "top_p-0": (COMPLETIONS, completion(top_p=0), 400, "top_p must be in (0, 1]", "top_p"),
    "top_p-above-1": (CHAT, chat(top_p=1.5), 400, "top_p", "top_p"),
    "top_k-0": (COMPLETIONS, completion(top_k=0), 400, "top_k", "top_k"),
    "top_k-below-minus-1": (COMPLETIONS, completion(top_k=-2), 400, "top_k", "top_k"),
    "min_p-negative": (COMPLETIONS, completion(min_p=-0.1), 400, "min_p", "min_p"),
    "min_p-above-1": (CHAT, chat(min_p=1.01), 400, "min_p", "min_p"),
    "presence_penalty-above-2": (COMPLETIONS, completion(presence_penalty=2.5), 400, "presence_penalty must be in [-2, 2]", "presence_penalty"),
    "frequency_penalty-below-minus-2": (CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty", "frequency_penalty"),
    "repetition_penalty-0": (COMPLETIONS, completion(repetition_penalty=0), 400, "repetition_penalty", "repetition_penalty"),
    # n and logprobs
    "n-0": (COMPLETIONS, completion(n=0), 400, "n must be an int >= 1", "n"),
    "n-above-limit": (CHAT, chat(n=17), 400, "n must be <= 16", "n"),
    "logprobs-above-limit": (COMPLETIONS, completion(logprobs=21), 400, "logprobs must be <= 20", "logprobs"),
    "logprobs-negative": (COMPLETIONS, completion(logprobs=-1), 400, "logprobs", "logprobs"),
    "top_logprobs-above-limit": (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs must be <= 20", "top_logprobs"),
    "top_logprobs-without-logprobs": (CHAT, chat(top_logprobs=0), 400, "needs logprobs", "top_logprobs"),
    # unknown model
    "unknown-model": (COMPLETIONS, completion(model="gpt-9"), 404, "model 'gpt-9' does not exist", "model"),
    "unknown-model-chat": (CHAT, chat(model="gpt-9"), 404, "does not exist", "model"),
    # wrong types
    "max_tokens-string": (COMPLETIONS, completion(max_tokens="10"), 400, "max_tokens", "max_tokens"),
    "n-float": (CHAT, chat(n=1.5), 400, "n: input should be a valid integer", "n"),
    "stream-string": (COMPLETIONS, completion(stream="yes"), 400, "stream", "stream"),
    "temperature-bool": (CHAT, chat(temperature=True), 400, "temperature", "temperature"),
    "stop-number": (COMPLETIONS, completion(stop=5), 400, "stop", "stop"),
    "stream_options-wrong": (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400, "include_usage", "stream_options.include_usage"),
    # messages
    "messages-missing": (CHAT, {"model": MODEL}, 400, "messages is required", "messages"),
    "messages-empty": (CHAT, chat(messages=[]), 400, "messages must not be empty", "messages"),
    "messages-not-list": (CHAT, chat(messages={"role": "user", "content": "hi"}), 400, "must be a list", "messages"),
    "messages-string": (CHAT, chat(messages="hi"), 400, "must be a list", "messages"),
    "message-not-object": (CHAT, chat(messages=["hi"]), 400, "messages[0] must be an object", "messages[0]"),
    "message-without-role": (CHAT, chat(messages=[{"content": "hi"}]), 400, "messages[0].role is required", "messages[0].role"),
    "message-without-content": (CHAT, chat(messages=[{"role": "user"}]), 400, "messages[0].content is required", "messages[0].content"),
    "message-unknown-role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role must be one of", "messages[0].role"),
    "message-content-number": (CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, "must be a string or a list", "messages[0].content"),
    "message-part-without-type": (CHAT, chat(messages=[{"role": "user", "content": [{"text": "x"}]}]), 400, "'type'", "messages[0].content[0]"),
    "message-part-text-not-string": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 1}]}]), 400, "text must be a string", "messages[0].content[0].text"),
    "message-part-audio": (CHAT, chat(messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]), 400, "not supported", "messages[0].content[0]"),
    # images sent to the bundled text-only model: refused unread, whatever they hold (tests/server/test_images.py
    # has every media check against a vision-language model)
    "image-url": (CHAT, chat(messages=image_part("https://example.com/cat.png")), 400, "no vision encoder", "messages[0].content[1]"),
    "image-data-url": (CHAT, chat(messages=image_part("data:image/png;base64,iVBORw0KGgo=")), 400, "no vision encoder", "messages[0].content[1]"),
    "image-not-base64": (CHAT, chat(messages=image_part("data:image/png;base64,@@@not base64@@@")), 400, "no vision encoder", "messages[0].content[1]"),
    "image-file-path": (CHAT, chat(messages=image_part("file:///etc/passwd")), 400, "no vision encoder", "messages[0].content[1]"),
    # prompts
    "prompt-missing": (COMPLETIONS, {"model": MODEL, "max_tokens": 4}, 400, "prompt is required", "prompt"),
    "prompt-empty-string": (COMPLETIONS, completion(prompt=""), 400, "prompt is empty", "prompt"),
    "prompt-empty-list": (COMPLETIONS, completion(prompt=[]), 400, "prompt is empty", "prompt"),
    "prompt-empty-token-list": (COMPLETIONS, completion(prompt=[[]]), 400, "prompt is empty", "prompt"),
    "prompt-negative-id": (COMPLETIONS, completion(prompt=[1, -3, 5]), 400, "token ids must be ints in [0, 262)", "prompt"),
    "prompt-id-outside-vocab": (COMPLETIONS, completion(prompt=[1, 262]), 400, "token ids must be ints in [0, 262)", "prompt"),
    "prompt-object": (COMPLETIONS, completion(prompt={"text": "hi"}), 400, "prompt must be a string", "prompt"),
    "prompt-mixed-list": (COMPLETIONS, completion(prompt=[1, "a"]), 400, "prompt must be a string", "prompt"),
    "prompt-bools": (COMPLETIONS, completion(prompt=[True, False]), 400, "prompt must be a string", "prompt"),
    "prompt-longer-than-context": (COMPLETIONS, completion(prompt="a" * 1100), 400, "prompt has 1100 tokens, the context length is 1024", "prompt"),
    "prompt-plus-max_tokens-over-context": (COMPLETIONS, completion(prompt="a" * 1000, max_tokens=200), 400, "prompt has 1000 tokens, max_tokens 200, context length 1024", "prompt"),
    "chat-prompt-plus-max_tokens-over-context": (CHAT, chat(messages=[{"role": "user", "content": "a" * 1000}], max_tokens=200), 400, "prompt has 1004 tokens, max_tokens 200, context length 1024", "prompt"),
    # stop sequences
    "stop-empty-string": (COMPLETIONS, completion(stop=""), 400, "stop entries must be non-empty", "stop"),
    "stop-empty-in-list": (CHAT, chat(stop=["x", ""]), 400, "stop entries must be non-empty", "stop"),
    "stop-too-many": (COMPLETIONS, completion(stop=[str(i) for i in range(17)]), 400, "stop has 17 sequences, the limit is 16", "stop"),
    "stop-too-long": (CHAT, chat(stop=["x" * 257]), 400, "at most 256 characters", "stop"),
    "stop_token_ids-too-many": (COMPLETIONS, completion(stop_token_ids=list(range(65))), 400,
                                "stop_token_ids has 65 ids, the limit is 64", "stop_token_ids"),
    "stop_token_ids-too-many-chat": (CHAT, chat(stop_token_ids=[5] * 100), 400, "the limit is 64", "stop_token_ids"),
    # features this server does not have
    "logit_bias": (COMPLETIONS, completion(logit_bias={"5": 10}), 400, "logit_bias is not supported", "logit_bias"),
    "tools": (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools are not supported", "tools"),
    "response_format-json": (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format", "response_format"),
    "best_of": (COMPLETIONS, completion(best_of=3), 400, "best_of is not supported", "best_of"),
    "echo-with-logprobs": (COMPLETIONS, completion(echo=True, logprobs=0), 400, "echo with logprobs", "echo"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_request_body(server, case):
    path, body, status, text, param = CASES[case]
    for stream in (False, True):  # refused before any stream starts, whether streaming or not
        r = server.post(path, {**body, "stream": stream} if "stream" not in body else body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert text in err["message"], err
        assert err["param"] == param and err["type"] and "code" in err
    complete_ok(server)


def raw(server, path: str, content: bytes | str, content_type: str | None = "application/json") -> httpx.Response:
    headers = dict(server.headers)
    if content_type:
        headers["Content-Type"] = content_type
    return server.http.post(path, content=content, headers=headers)


@pytest.mark.parametrize("body,text", [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    (b'"a string"', "must be a JSON object, got a string"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b"42", "must be a JSON object, got a number"),
    (b"null", "must be a JSON object, got null"),
    (b"[" * 100000 + b"]" * 100000, "JSON"),
], ids=["broken", "empty", "not-utf8", "string", "list", "number", "null", "deeply-nested"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_body_that_is_not_a_json_object(server, path, body, text):
    r = raw(server, path, body)
    assert r.status_code == 400, r.text
    assert text in r.json()["error"]["message"]
    complete_ok(server)


def test_omitted_max_tokens_means_the_rest_of_the_context(server):
    r = server.post(COMPLETIONS, {"prompt": [7] * 1020, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    r = server.post(CHAT, {"messages": [{"role": "user", "content": "y" * 1016}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 1020, "completion_tokens": 4, "total_tokens": 1024}
    complete_ok(server)


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, b'{"prompt": "a\\ud800b"}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages"),
], ids=["prompt", "message"])
def test_lone_surrogate_is_not_text(server, path, body, param):
    # JSON escapes can encode half of a UTF-16 pair, which no UTF-8 text holds
    r = raw(server, path, body)
    assert r.status_code == 400 and f"{param} is not valid Unicode" in r.json()["error"]["message"], r.text
    complete_ok(server)


def test_nan_and_infinite_temperature(server):
    # JSON has no NaN or Infinity, but Python's parser accepts the literals: they must still be refused
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        r = raw(server, COMPLETIONS, b'{"prompt": "hi", "temperature": ' + literal + b"}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text
    complete_ok(server)


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_wrong_content_type(server, ctype):
    r = raw(server, COMPLETIONS, b'{"prompt": "hi"}', ctype)
    assert r.status_code == 400 and "Content-Type must be application/json" in r.json()["error"]["message"], r.text
    complete_ok(server)


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing-here", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["message"] == "unknown route: GET /v1/nothing-here"
    r = httpx.post(server.url + "/v2/completions", headers=server.headers, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + COMPLETIONS, headers=server.headers)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]
    r = httpx.get(server.url + "/v1/models/gpt-9", headers=server.headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    complete_ok(server)


def test_oversized_body(server):
    big = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = raw(server, COMPLETIONS, big)
    assert r.status_code == 413 and "larger than the limit of 4194304 bytes" in r.json()["error"]["message"], r.text

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * (64 << 10)
        yield b'"}'

    r = httpx.post(server.url + COMPLETIONS, content=chunks(), timeout=30,
                   headers={**server.headers, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    complete_ok(server)
