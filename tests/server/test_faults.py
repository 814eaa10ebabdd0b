"""Engine faults seen through the app, in-process on the tiny model: NaN logits in one request, an engine
step that raises, an engine thread that dies. Also the ``serve`` command's defaults and start-up errors."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest
from fastapi.testclient import TestClient

from dayzero import cli
from dayzero.engine.engine import EngineConfig, LLMEngine
from dayzero.server.app import build_app
from dayzero.server.async_engine import AsyncEngine
from dayzero.server.launcher import server_limits
from dayzero.server.limits import ServerLimits

POISON_SEED = 666  # requests with this seed get non-finite logits


@pytest.fixture()
def app_and_engine(tiny_ckpt):
    async_engine = AsyncEngine(lambda: LLMEngine(EngineConfig(model=str(tiny_ckpt), device="cpu", dtype="float32",
                                                             num_cache_blocks=128)))
    engine = async_engine.engine
    real = engine.sampler

    def sampler(logits, params, generators, output_ids=None):
        out = real(logits, params, generators, output_ids)
        for i, p in enumerate(params):
            if p.seed == POISON_SEED:  # what the sampler reports for a row with NaN or inf logits
                out.token_ids[i] = -1
        return out

    engine.sampler = sampler
    return build_app(async_engine, "tiny"), engine


def sse_events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def assert_idle(c: TestClient) -> None:
    m = c.get("/metrics").text
    assert "dayzero_cache_blocks_used 0.0" in m and "dayzero_state_slots_used 0.0" in m, m


def test_non_finite_logits_fail_only_that_request(app_and_engine):
    app, _ = app_and_engine
    with TestClient(app) as c:
        results = {}

        def run(name, seed):
            results[name] = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 30, "seed": seed,
                                                            "ignore_eos": True})

        threads = [threading.Thread(target=run, args=("good", 1)), threading.Thread(target=run, args=("bad", POISON_SEED))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 30
        bad = results["bad"]
        assert bad.status_code == 500 and bad.json()["error"]["code"] == "non_finite_logits"
        # streamed: a final error event, then [DONE]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "seed": POISON_SEED,
                                                 "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and "NaN or infinite logits" in json.loads(events[-2])["error"]["message"]
        assert_idle(c)
        assert c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 3}).status_code == 200


def test_failing_engine_step_fails_its_requests_and_the_server_stays_up(app_and_engine):
    app, engine = app_and_engine
    real_step = engine.step
    calls = []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real_step()

    engine.step = step
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 500 and "the engine step failed: RuntimeError: boom" in r.json()["error"]["message"]
        assert c.get("/health").json() == {"status": "ok"}
        assert_idle(c)
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5


def test_dead_engine_thread_shows_in_health(app_and_engine):
    app, engine = app_and_engine

    def has_unfinished():
        raise SystemError("engine lost")

    with TestClient(app) as c:
        engine.has_unfinished = has_unfinished
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})  # wakes the thread, which dies
        assert r.status_code in (500, 503), r.text
        h = c.get("/health")
        assert h.status_code == 503 and "engine lost" in h.json()["error"]
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_serve_defaults_are_the_server_limits(monkeypatch):
    got = []
    monkeypatch.setattr("dayzero.server.launcher.serve", lambda args: got.append(args) or 0)
    assert cli.main(["serve"]) == 0
    args = got[0]
    assert server_limits(args) == ServerLimits()  # every limit the command line offers defaults to the server's
    assert (args.host, args.port, args.model, args.api_key) == ("127.0.0.1", 8000, None, None)


@pytest.mark.parametrize("args,message", [
    (["/nonexistent/model"], "no config.json at /nonexistent/model"),
    (["--max-n", "0"], "max_n must be an int >= 1, got 0"),
], ids=["missing-checkpoint", "bad-limit"])
def test_serve_refuses_to_start_with_a_clear_message(args, message):
    r = subprocess.run([sys.executable, "-m", "dayzero.cli", "serve", "--device", "cpu", "--port", "1", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr, r.stderr
