"""Slow, idle and too many clients: header, body and keep-alive timeouts close them, a cap on connections
refuses the surplus cleanly (idle ones make room for new ones first), the server keeps answering /health
and real requests, and it logs each kind of error at most once a second."""
from __future__ import annotations

import re
import socket
import threading
import time
from collections import defaultdict
from datetime import datetime

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL, ServerProcess

CAP = 8
ORIGIN = "https://app.example"
FLAGS = ("--timeout-header", "1", "--timeout-body", "1.5", "--timeout-keep-alive", "1", "--max-connections", str(CAP),
         "--allowed-origins", ORIGIN)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("conns"), "--max-model-len", "1024", "--num-cache-blocks", "512", *FLAGS,
                      api_key=API_KEY)
    yield s
    assert s.stop() == 0, s.log()


def connect(srv) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port))
    s.settimeout(10)
    return s


def read_until_closed(s: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    out, t0 = b"", time.monotonic()
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out, time.monotonic() - t0


def ok(srv) -> None:
    assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    srv.wait_idle()


@pytest.mark.parametrize("send,status,after", [
    (b"", None, 1.0),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"408", 1.0),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer "
     + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"pr", b"408", 1.5),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"200", 1.0),  # then idle on keep-alive
], ids=["idle", "half-sent-head", "half-sent-body", "idle-keep-alive"])
def test_idle_and_half_sent_connections_are_closed(srv, send, status, after):
    s = connect(srv)
    s.sendall(send)
    got, took = read_until_closed(s)
    s.close()
    if status is None:
        assert got == b""
    else:
        assert got.startswith(b"HTTP/1.1 " + status), got
    assert after - 0.2 < took < after + 2, f"closed after {took:.2f}s"
    if status == b"408":
        assert b'"code": "request_timeout"' in got
    ok(srv)


def test_connections_past_the_cap_with_requests_in_progress_get_a_503(srv):
    streams = []
    body = {"model": MODEL, "prompt": "busy", "max_tokens": 500, "ignore_eos": True, "stream": True}
    started = threading.Barrier(CAP + 1)
    stop = threading.Event()

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=srv.headers, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            started.wait(30)
            stop.wait(30)

    for _ in range(CAP):
        streams.append(threading.Thread(target=stream))
        streams[-1].start()
    started.wait(30)
    s = connect(srv)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    got, _ = read_until_closed(s)
    s.close()
    assert got.startswith(b"HTTP/1.1 503") and b"too_many_connections" in got, got
    stop.set()
    for t in streams:
        t.join(30)
    ok(srv)


def refusal(r: httpx.Response) -> bool:
    return r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"


def refused_or(request) -> httpx.Response | None:
    """The response, or None where the server closed the connection before answering: past its lingering
    allowance a refusal closes at once, and a request it never read makes that close a reset. Both are
    clean refusals a client retries."""
    try:
        return request()
    except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
        return None


def test_a_flood_of_connections_without_a_key_is_refused_cleanly(srv):
    """Hundreds of connections (keyless requests, garbage, nothing at all) against a cap of 8: each gets an
    answer (401, 400, 503, 408) or a clean close, never a hang. Meanwhile /health and a real request get a
    200, or a clean 503 or close that a retry gets past; after the flood everything is as before."""
    flood: list[socket.socket] = []
    kinds = [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"NOT HTTP AT ALL\r\n\r\n", b""]
    done = threading.Event()

    def open_flood():
        for i in range(600):
            try:
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
                s.sendall(kinds[i % 3])
                flood.append(s)
            except OSError:  # refused or reset by the server: also clean
                pass
        done.set()

    t = threading.Thread(target=open_flood)
    t.start()
    health = []
    while not done.is_set():
        r = refused_or(lambda: httpx.get(srv.url + "/health", timeout=5))
        assert r is None or r.status_code == 200 or refusal(r)
        health.append(r)
    deadline = time.monotonic() + 30
    while (r := refused_or(lambda: srv.post("/v1/completions", {"model": MODEL, "prompt": "real", "max_tokens": 4}))) \
            is None or refusal(r):
        assert time.monotonic() < deadline
    assert r.status_code == 200, r.text
    t.join(60)
    assert health
    statuses = defaultdict(int)
    for s in flood:
        s.settimeout(10)
        got, took = read_until_closed(s)  # closed within the timeouts: nothing hangs
        s.close()
        statuses[got[9:12].decode() or "closed"] += 1
    assert set(statuses) <= {"401", "400", "503", "408", "closed"}, statuses
    assert statuses["401"] > 0 and statuses["400"] > 0
    ok(srv)
    assert_each_error_at_most_once_a_second(srv.log())


def test_cors_preflight_for_allowed_origins_only(srv, server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(srv.url + "/v1/chat/completions", headers=preflight)  # no key: browsers send none here
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    r = httpx.options(srv.url + "/v1/chat/completions", headers={**preflight, "Origin": "https://elsewhere.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN, **srv.headers})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    # off by default: the session server answers no preflight
    r = httpx.options(server.url + "/v1/chat/completions", headers=preflight)
    assert r.status_code in (401, 405) and "access-control-allow-origin" not in r.headers


def assert_each_error_at_most_once_a_second(log: str) -> None:
    last: dict[str, datetime] = {}
    seen = 0
    for line in log.splitlines():
        m = re.match(r"(\S+ \S+) (WARNING|ERROR) (\S+): (.*)", line)
        if not m:
            continue
        seen += 1
        when = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")
        kind = m.group(3) + re.sub(r"\d+", "N", re.sub(r" \(\d+ more like it.*\)$", "", m.group(4)))
        if kind in last:
            assert (when - last[kind]).total_seconds() >= 0.99, f"logged twice within a second: {line}"
        last[kind] = when
    assert seen > 0, "no warning was logged: the flood did not exercise the log limit"
