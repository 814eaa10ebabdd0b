"""Under load and faults: 64 concurrent streams, clients that hang up, SIGTERM while requests run."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx

from tests.server.conftest import MODEL, ServerProcess, complete_ok


def test_64_concurrent_streams_of_mixed_lengths(server):
    before = server.metrics()
    rng = random.Random(0)
    jobs = [("word " * rng.randint(1, 24), rng.randint(1, 32)) for _ in range(64)]

    async def one(client, prompt, max_tokens, i):
        kw = dict(model=MODEL, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                  extra_body={"ignore_eos": True}, seed=i)
        tokens, finish, usage = 0, None, None
        if i % 2:
            stream = await client.completions.create(prompt=prompt, logprobs=0, **kw)
            async for c in stream:
                usage = c.usage or usage
                for ch in c.choices:
                    tokens += len(ch.logprobs.tokens) if ch.logprobs else 0
                    finish = ch.finish_reason or finish
        else:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], logprobs=True, **kw)
            async for c in stream:
                usage = c.usage or usage
                for ch in c.choices:
                    tokens += len(ch.logprobs.content) if ch.logprobs else 0
                    finish = ch.finish_reason or finish
        return tokens, finish, usage

    async def main():
        async with server.async_client(timeout=300) as client:
            return await asyncio.gather(*(one(client, p, m, i) for i, (p, m) in enumerate(jobs)))

    results = asyncio.run(main())
    for (prompt, max_tokens), (tokens, finish, usage) in zip(jobs, results):
        assert tokens == max_tokens and finish == "length" and usage.completion_tokens == max_tokens
    after = server.wait_idle()
    assert after["dayzero_cache_blocks_free"] == 2047 and after["dayzero_state_slots_free"] == 64
    finished = "dayzero_requests_total{outcome=finished}"
    assert after[finished] - before.get(finished, 0) == 64
    assert after["dayzero_generation_tokens_total"] - before["dayzero_generation_tokens_total"] == sum(m for _, m in jobs)
    assert after["dayzero_aborts_total"] == before["dayzero_aborts_total"]


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_aborts_and_frees_the_cache(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in got)
        assert server.metrics()["dayzero_cache_blocks_used"] > 0
    # the connection is closed: the server aborts at once, long before 1000 tokens
    _wait_for(lambda: server.metrics()["dayzero_aborts_total"] == before["dayzero_aborts_total"] + 1)
    m = server.wait_idle(timeout=5)
    assert m["dayzero_requests_total{outcome=aborted}"] == before.get("dayzero_requests_total{outcome=aborted}", 0) + 1
    complete_ok(server)


def test_client_disconnect_during_non_streamed_request(server):
    before = server.metrics()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(60, read=1.0)) as c:
        try:
            c.post(server.url + "/v1/chat/completions", json=body, headers=server.headers)
            raise AssertionError("1000 tokens in under a second")
        except httpx.ReadTimeout:
            pass
    _wait_for(lambda: server.metrics()["dayzero_aborts_total"] == before["dayzero_aborts_total"] + 1)
    server.wait_idle(timeout=5)
    complete_ok(server)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_sigterm_during_load_drains_and_exits_0(tmp_path):
    """Short requests in flight finish; long ones end with an error event and [DONE] before the timeout;
    the process exits 0 within the timeout and leaves no child behind."""
    srv = ServerProcess(tmp_path, "--shutdown-timeout", "3", "--max-model-len", "4096", "--num-cache-blocks", "1024")
    results: dict[str, list[str]] = {}
    started = {name: threading.Event() for name in [f"long{i}" for i in range(6)] + ["short"]}

    def stream(name, max_tokens):
        body = {"prompt": name, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = results[name] = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started[name].set()

    threads = [threading.Thread(target=stream, args=(f"long{i}", 3000)) for i in range(6)]
    for t in threads:
        t.start()
    assert all(started[f"long{i}"].wait(60) for i in range(6))
    threads.append(threading.Thread(target=stream, args=("short", 8)))  # in flight when the signal comes
    threads[-1].start()
    assert started["short"].wait(60)
    assert srv.metrics()["dayzero_requests_running"] >= 6  # requests from separate connections share the batch
    children = _children(srv.proc.pid)
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    rc = srv.proc.wait(30)
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join(10)
    assert rc == 0, srv.log()
    assert elapsed < 3 + 3, f"took {elapsed:.1f}s to stop"
    assert results["short"][-1] == "data: [DONE]" and '"finish_reason": "length"' in results["short"][-2]
    for i in range(6):
        lines = results[f"long{i}"]
        assert lines[-1] == "data: [DONE]" and "the server is shutting down" in lines[-2], lines[-3:]
    assert all(not os.path.exists(f"/proc/{c}") for c in children)
    log = srv.log()
    assert "aborting 6 requests still in flight" in log
    srv.stop()
