"""Expensive requests: cheap bounds (message count, characters of text) are checked before any templating
or tokenization, and that work runs off the event loop, so /health keeps answering while a 4 MB chat is
templated and tokenized."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, ServerProcess, complete_ok

CHAT = "/v1/chat/completions"


def history(n: int, chars: int) -> list[dict]:
    return [{"role": ("user", "assistant")[i % 2], "content": "x" * chars} for i in range(n + 1)]


@pytest.mark.parametrize("path,body,param,text", [
    (CHAT, {"messages": history(5000, 1)}, "messages", "messages holds 5001 messages, the limit is 4096"),
    # 1024 tokens of context, no token longer than 13 characters: 60000 characters cannot fit
    (CHAT, {"messages": history(0, 60000)}, "messages",
     "messages holds 60000 characters of text, the limit is 53248 (more cannot fit in the context of 1024 tokens)"),
    ("/v1/completions", {"prompt": "y" * 60000}, "prompt", "prompt holds 60000 characters of text, the limit is 53248"),
    ("/v1/completions", {"prompt": ["ok", "y" * 60000]}, "prompt[1]", "prompt[1] holds 60000 characters"),
], ids=["message-count", "chat-characters", "prompt-characters", "second-prompt-characters"])
def test_cheap_bounds_come_first(server, path, body, param, text):
    t = time.perf_counter()
    r = server.post(path, {"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    assert time.perf_counter() - t < 2.0
    complete_ok(server)


def test_health_answers_while_a_4mb_chat_is_templated(tmp_path):
    srv = ServerProcess(tmp_path, "--max-model-len", "1024", "--num-cache-blocks", "256", "--max-body-bytes", str(8 << 20),
                        "--max-prompt-chars", "8000000", "--max-messages", "100000")
    try:
        body = {"messages": history(20000, 180), "max_tokens": 1}  # 4.3 MB of JSON, 3,640,184 tokens once templated
        result = {}

        def chat():
            t = time.perf_counter()
            result["r"] = httpx.post(srv.url + CHAT, json=body, timeout=120)
            result["took"] = time.perf_counter() - t

        worker = threading.Thread(target=chat)
        worker.start()
        latencies = []
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while worker.is_alive():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - t)
                time.sleep(0.02)
        worker.join()
        r = result["r"]
        assert r.status_code == 400 and "prompt has 3640184 tokens, the context length is 1024" in r.text, r.text
        assert result["took"] > 1.0, "the chat was not expensive: the test did not exercise the case"
        assert len(latencies) > 10 and max(latencies) < 0.5, f"/health took up to {max(latencies):.2f}s"
        r = srv.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
