"""A real ``dayzero serve`` process on a free loopback port, and helpers to read its metrics."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "sk-test-0123456789"
MODEL = "dayzero-default"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m dayzero.cli serve ...`` with its log in a file; ``stop`` sends a signal and returns the status."""

    def __init__(self, log_dir: Path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dayzero.cli", "serve", "--device", "cpu", "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = log_dir / f"server-{self.port}.log"
        self._log = open(self.log_path, "w")
        # one compute thread: the server and the test client share a small machine, and an oversubscribed
        # OpenMP pool slows the tiny model down by orders of magnitude
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.http = httpx.Client(base_url=self.url, timeout=60.0)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none", max_retries=0, **kw)

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return self.http.post(path, json=body, headers=headers, **kw)

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels, if any, as ``name{k=v}``) -> value."""
        r = self.http.get("/metrics", headers=self.headers)
        r.raise_for_status()
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
                if "le" in s.labels:
                    continue
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Wait until nothing runs or waits and every cache block and state slot is free; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (m["dayzero_requests_running"] == 0 and m["dayzero_requests_waiting"] == 0
                    and m["dayzero_requests_queued"] == 0
                    and m["dayzero_cache_blocks_used"] == 0 and m["dayzero_state_slots_used"] == 0)
            if idle or time.monotonic() > deadline:
                assert idle, f"server not idle: {m}"
                return m
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.http.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def random_model(tmp_path_factory) -> Path:
    """Random weights of the bundled model's family (``configs/dayzero-default.json``) with its tokenizer: the API
    tests want near-uniform next-token distributions (streams that hold multi-byte characters, samples that
    differ by seed), which the trained bundled model no longer gives."""
    import json

    import torch

    from dayzero.tools.build_default_model import build_checkpoint

    config = json.loads((ROOT / "configs" / "dayzero-default.json").read_text())
    return build_checkpoint(tmp_path_factory.mktemp("random-default"), config, seed=0, save_dtype=torch.bfloat16)


@pytest.fixture(scope="session")
def server(tmp_path_factory, random_model):
    """A random-weight model of the bundled family, served as ``dayzero-default`` behind an API key: the server
    most tests talk to."""
    srv = ServerProcess(tmp_path_factory.mktemp("serve"), str(random_model), "--served-model-name", MODEL,
                        "--num-cache-blocks", "2048", "--max-model-len", "1024", api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return server.client()


def complete_ok(server: ServerProcess) -> None:
    """A valid request still succeeds and leaves the cache empty."""
    r = server.post("/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    server.wait_idle()
