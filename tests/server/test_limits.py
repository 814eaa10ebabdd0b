"""Configurable limits on a server started with small ones: each refused with a clear error, and the server
stays healthy. Also a tiny cache: requests larger than the whole cache are refused, and preemption under
cache pressure keeps greedy outputs identical."""
from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess

LIMITS = ["--max-concurrent-requests", "2", "--max-queue-len", "1", "--max-n", "2", "--max-logprobs", "1",
          "--max-stop-sequences", "2", "--max-stop-length", "4", "--max-prompts", "3", "--max-body-bytes", "2048",
          "--max-model-len", "512", "--num-cache-blocks", "17", "--block-size", "16", "--max-num-seqs", "8"]


@pytest.fixture(scope="module")
def small(tmp_path_factory, random_model):
    # no API key: every route is open; the random-weight model of the bundled family, whose requests run their
    # whole max_tokens at the rate the tests' timing assumes
    srv = ServerProcess(tmp_path_factory.mktemp("limits"), str(random_model), "--served-model-name", MODEL, *LIMITS)
    yield srv
    assert srv.stop(signal.SIGINT) == 0, srv.log()  # Ctrl-C also drains and exits 0


def wait_for(cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def ok(srv: ServerProcess) -> None:
    r = srv.post("/v1/completions", {"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    srv.wait_idle()


@pytest.mark.parametrize("path,body,status,text", [
    ("/v1/completions", {"prompt": "x", "n": 3}, 400, "n must be <= 2 (the server's limit), got 3"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs must be <= 1 (the server's limit), got 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, 400,
     "top_logprobs must be <= 1"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c"]}, 400, "stop has 3 sequences, the limit is 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": "abcde"}, 400,
     "stop sequences must be at most 4 characters, got one of 5"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, 400, "prompt holds 4 prompts, the limit is 3"),
    ("/v1/completions", {"prompt": "x" * 3000}, 413, "larger than the limit of 2048 bytes"),
    ("/v1/completions", {"prompt": [5] * 600}, 400, "prompt has 600 tokens, the context length is 512"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": 300}, 400,
     "request needs up to 400 tokens of cache but the whole cache holds 256"),
    ("/v1/completions", {"prompt": [[97, 98], [5] * 100], "max_tokens": 200}, 400, "prompt 1: request needs up to 300 tokens"),
], ids=["n", "logprobs", "top_logprobs", "stop-count", "stop-length", "prompts", "body-size", "context",
        "whole-cache", "whole-cache-second-prompt"])
def test_limit(small, path, body, status, text):
    r = small.post(path, {"model": MODEL, **body})
    assert r.status_code == status, r.text
    assert text in r.json()["error"]["message"]
    ok(small)


def test_omitted_max_tokens_is_what_fits_in_the_cache(small):
    """The context is 512 tokens but the whole cache holds 256: without max_tokens, a request gets the rest
    of the cache instead of a refusal."""
    r = small.post("/v1/completions", {"prompt": [5] * 200, "max_tokens": None, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 56 and r.json()["choices"][0]["finish_reason"] == "length"
    r = small.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 196}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 200, "completion_tokens": 56, "total_tokens": 256}
    r = small.post("/v1/completions", {"prompt": [5] * 300, "max_tokens": None})
    assert r.status_code == 400 and "prompt has 300 tokens but the whole cache holds 256" in r.json()["error"]["message"]
    ok(small)


def test_full_queue_gets_429_and_a_queued_client_that_leaves_frees_its_place(small):
    """Two requests run, one waits; a fourth is refused. The waiting client leaves: its place is free at once."""
    # two streams of 244 tokens in a 256-token cache: one is preempted until the other ends, so both
    # are still running while the rest of the test happens
    body = {"prompt": "long", "max_tokens": 240, "ignore_eos": True, "stream": True}
    stop = threading.Event()
    first_chunk = [threading.Event(), threading.Event()]

    def run(i):
        with httpx.stream("POST", small.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                first_chunk[i].set()
                if stop.is_set():
                    return

    runners = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in runners:
        t.start()
    assert all(e.wait(60) for e in first_chunk)
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as c:  # queued: times out and hangs up
        with pytest.raises(httpx.ReadTimeout):
            c.post(small.url + "/v1/completions", json={"prompt": "queued", "max_tokens": 2})
    wait_for(lambda: small.metrics()["dayzero_requests_queued"] == 0, 10)  # its place in the queue is free again
    statuses = []
    queued = threading.Thread(target=lambda: statuses.append(small.post("/v1/completions", {"prompt": "q", "max_tokens": 2}).status_code))
    queued.start()
    wait_for(lambda: small.metrics()["dayzero_requests_queued"] == 1, 30)
    r = small.post("/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and "2 requests running (limit 2) and 1 queued (limit 1)" in err["message"]
    stop.set()
    for t in runners:
        t.join(60)
    queued.join(60)
    assert statuses == [200]  # the queued request ran once the streams were gone
    assert small.metrics()["dayzero_request_errors_total{status=429}"] >= 1
    ok(small)


def test_preemption_under_cache_pressure_keeps_greedy_outputs(small):
    """Two requests of two prompts each: 4 sequences of 110 tokens in a 256-token cache. The scheduler
    preempts and recomputes, and every greedy output is the one its prompt gets alone."""
    prompts = [[10 + i] * 30 for i in range(4)]
    body = {"max_tokens": 80, "temperature": 0, "ignore_eos": True}
    alone = [small.post("/v1/completions", {"prompt": p, **body}).json()["choices"][0]["text"] for p in prompts]
    before = small.metrics()["dayzero_preemptions_total"]
    results = [None, None]

    def go(i):
        results[i] = small.post("/v1/completions", {"prompt": prompts[2 * i:2 * i + 2], **body}).json()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    got = [c["text"] for r in results for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert got == alone
    m = small.wait_idle()
    assert m["dayzero_preemptions_total"] > before
