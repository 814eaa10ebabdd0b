"""Any number in any field, however long or out of range: a 4xx naming the field, never a 500 (and the
connection stays usable). JSON integers are exact, so a body can hold ones that no 64-bit field can take."""
from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, complete_ok

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TOO_BIG, TOO_SMALL = str(1 << 63), str(-(1 << 63) - 1)


def post_raw(server, path: str, body: bytes):
    return server.http.post(path, content=body, headers={**server.headers, "Content-Type": "application/json"})


def completion(field: str, value: str) -> bytes:
    return b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "%s": %s}' % (MODEL.encode(), field.encode(), value.encode())


def chat(field: str, value: str) -> bytes:
    return (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": true, '
            b'"%s": %s}' % (MODEL.encode(), field.encode(), value.encode()))


NUMERIC = ["n", "max_tokens", "seed", "top_k", "min_tokens", "logprobs", "temperature", "top_p", "min_p",
           "presence_penalty", "frequency_penalty", "repetition_penalty"]


@pytest.mark.parametrize("value", [TOO_BIG, TOO_SMALL], ids=["2**63", "-2**63-1"])
@pytest.mark.parametrize("field", NUMERIC)
def test_integers_outside_64_bits_are_a_400_naming_the_field(server, field, value):
    r = post_raw(server, COMPLETIONS, completion(field, value))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "out of range" in err["message"] and "64 bits" in err["message"], err


@pytest.mark.parametrize("path,body,param", [
    (CHAT, chat("top_logprobs", TOO_BIG), "top_logprobs"),
    (CHAT, chat("max_completion_tokens", TOO_SMALL), "max_completion_tokens"),
    (CHAT, chat("stop_token_ids", f"[1, {TOO_BIG}]"), "stop_token_ids[1]"),
    (COMPLETIONS, completion("stream_options", '{"include_usage": %s}' % TOO_BIG), "stream_options.include_usage"),
    (COMPLETIONS, completion("best_of", TOO_BIG), "best_of"),
], ids=["top_logprobs", "max_completion_tokens", "stop_token_ids", "stream_options", "best_of"])
def test_integers_outside_64_bits_in_other_fields(server, path, body, param):
    r = post_raw(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_out_of_range_token_id_is_refused_with_the_vocabulary(server):
    r = post_raw(server, COMPLETIONS, b'{"prompt": [1, %s], "max_tokens": 2}' % TOO_BIG.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt" and "must be ints in [0, 262)" in r.json()["error"]["message"]


@pytest.mark.parametrize("where", ["max_tokens", "prompt", "unknown_field", "messages"])
def test_an_integer_of_more_than_4300_digits_anywhere_is_a_400(server, where):
    huge = "9" * 5000
    body = {
        "max_tokens": completion("max_tokens", huge),
        "prompt": b'{"prompt": [%s]}' % huge.encode(),
        "unknown_field": completion("vendor_extension", "[%s]" % huge),
        "messages": b'{"messages": [{"role": "user", "content": "hi", "n": %s}]}' % huge.encode(),
    }[where]
    for _ in range(2):  # the same connection, twice: the server answered and kept it
        r = post_raw(server, CHAT if where == "messages" else COMPLETIONS, body)
        assert r.status_code == 400, r.text
        assert "an integer of 5000 digits" in r.json()["error"]["message"]
    complete_ok(server)


@pytest.mark.parametrize("field,value", [
    ("seed", str((1 << 63) - 1)), ("seed", str(-(1 << 63))), ("top_k", str(1 << 62)), ("n", str(1 << 62)),
    ("max_tokens", str(1 << 62)), ("min_tokens", str(1 << 62)), ("logprobs", str(1 << 62)),
    ("stop_token_ids", f"[{1 << 62}]"), ("temperature", "1e308"), ("top_p", "1e-320"),
], ids=lambda v: v[:12])
def test_large_numbers_within_64_bits_are_never_a_500(server, field, value):
    r = post_raw(server, COMPLETIONS, completion(field, value))
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["param"] in (field, "prompt"), r.text
    server.wait_idle()
