"""What a stream costs the server: the engine hands over one step's tokens and text at a time (never the
output so far), and a client that stops reading is aborted once it is too far behind, its connection
closed once its response has stalled for the body timeout."""
from __future__ import annotations

import json
import socket
import time

import pytest

from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.engine.sampling_params import SamplingParams
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(device="cpu", num_cache_blocks=128, max_model_len=512))


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_delta_outputs_carry_one_step_and_add_up_to_the_whole(engine):
    params = SamplingParams(n=2, max_tokens=48, temperature=1.0, seed=5, logprobs=2, ignore_eos=True, stop=["q!"])
    prompt = list("héllo 你好".encode())
    engine.add_request("whole", prompt, params)
    whole = {o.index: o for o in _run(engine)[-1].outputs}
    engine.add_request("delta", prompt, params, delta=True)
    got = {i: {"text": "", "ids": [], "lps": [], "tops": [], "reason": None} for i in range(2)}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.prompt_token_ids == []  # not copied again every step
            for o in out.outputs:
                assert len(o.token_ids) <= 1 and len(o.logprobs) == len(o.token_ids)
                g = got[o.index]
                g["text"] += o.text
                g["ids"] += o.token_ids
                g["lps"] += o.logprobs
                g["tops"] += o.top_logprobs
                g["reason"] = o.finish_reason or g["reason"]
        steps += 1
    for i, w in whole.items():
        g = got[i]
        assert (g["text"], g["ids"], g["lps"], g["tops"], g["reason"]) == (
            w.text, w.token_ids, w.logprobs, w.top_logprobs, w.finish_reason)
    assert steps >= 48


def test_a_client_that_stops_reading_is_aborted_and_its_connection_closed(tmp_path, random_model):
    # the random-weight model: its events (multi-byte tokens, their escaped alternatives) fill the socket buffers
    # within the test's time; the trained model's short ASCII events take several times as many tokens
    srv = ServerProcess(tmp_path, str(random_model), "--max-model-len", "2048", "--num-cache-blocks", "2048",
                        "--max-stream-backlog", "16", "--timeout-body", "2")
    try:
        before = srv.metrics()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.port))
        # 16 outputs of 1000 tokens with 20 alternatives each: far more than socket buffers hold
        body = json.dumps({"prompt": "x", "max_tokens": 1000, "n": 16, "ignore_eos": True, "stream": True,
                           "logprobs": 20}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")  # then it reads nothing more
        deadline = time.monotonic() + 120
        while srv.metrics()["dayzero_aborts_total"] == before["dayzero_aborts_total"]:
            assert time.monotonic() < deadline, "the request was never aborted"
            time.sleep(0.2)
        m = srv.wait_idle()
        assert m["dayzero_generation_tokens_total"] - before["dayzero_generation_tokens_total"] < 16 * 1000
        assert m["dayzero_requests_total{outcome=aborted}"] == before.get("dayzero_requests_total{outcome=aborted}", 0) + 1
        assert "behind its stream (the limit is 16 per output): request aborted" in srv.log()
        # the stalled response is given up on: reading now finds the connection closed after what was buffered
        sock.settimeout(30)
        with pytest.raises((ConnectionResetError, EOFError)):
            time.sleep(3)
            while sock.recv(1 << 20):
                pass
            raise EOFError
        r = srv.post("/v1/completions", {"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
