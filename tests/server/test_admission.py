"""A request's prompts enter the engine together or not at all: a bad later prompt admits none, a client that
leaves while a many-prompt request is being admitted leaves nothing running, and the prompts of one request
(and requests that arrive while others decode) join the same step instead of one per step."""
from __future__ import annotations

import json
import socket
import time

import pytest

from tests.server.conftest import MODEL, complete_ok

COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("prompt,text", [
    (["abc", ""], "prompt 1 is empty"),
    ([[97, 98], [97, 300]], "prompt 1: prompt token ids must be ints in [0, 262)"),
    ([[97, 98], [97] * 1030], "prompt 1: prompt has 1030 tokens, the context length is 1024"),
    ([[97, 98], [97] * 1000], "prompt 1: prompt has 1000 tokens, max_tokens 100, context length 1024"),
], ids=["empty", "outside-vocab", "longer-than-context", "prompt-plus-max_tokens"])
def test_a_bad_later_prompt_admits_none(server, prompt, text):
    before = server.metrics()
    r = server.post(COMPLETIONS, {"model": MODEL, "prompt": prompt, "max_tokens": 100, "ignore_eos": True})
    assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
    after = server.wait_idle()
    for name in ("dayzero_aborts_total", "dayzero_generation_tokens_total", "dayzero_prompt_tokens_total"):
        assert after[name] == before[name], name  # prompt 0 never ran, so nothing had to be aborted
    complete_ok(server)


def _post_and_leave(server, body: dict, wait: float) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + server.api_key.encode() + b"\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(data) + data)
        time.sleep(wait)


@pytest.mark.parametrize("wait", [0.0, 0.05, 0.3], ids=["at-once", "while-admitted", "after-admission"])
def test_client_that_leaves_during_a_many_prompt_request_leaves_nothing_running(server, wait):
    """64 prompts of 300 tokens each would run for minutes on this machine; once the client is gone, every
    one of them is out of the engine at once, whatever moment it left at."""
    before = server.metrics()
    _post_and_leave(server, {"prompt": [[97 + i % 26] * 8 for i in range(64)], "max_tokens": 300,
                             "ignore_eos": True}, wait)
    m = server.wait_idle(timeout=10)
    assert m["dayzero_generation_tokens_total"] - before["dayzero_generation_tokens_total"] < 64 * 300
    complete_ok(server)


def _elapsed(server, body: dict) -> float:
    t = time.perf_counter()
    r = server.post(COMPLETIONS, {"model": MODEL, "max_tokens": 16, "ignore_eos": True, "temperature": 1.0, **body})
    assert r.status_code == 200, r.text
    return time.perf_counter() - t


def test_the_prompts_of_one_request_join_the_same_step(server):
    """16 prompts cost about what one prompt with n=16 does (each is one sequence of the same batch); added
    one per step they took 4-6 times as long."""
    one = min(_elapsed(server, {"prompt": "hello world", "n": 16}) for _ in range(2))
    many = min(_elapsed(server, {"prompt": ["hello world"] * 16}) for _ in range(2))
    assert many < 2.0 * one, f"16 prompts took {many:.2f}s, one prompt with n=16 {one:.2f}s"
