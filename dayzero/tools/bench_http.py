"""The server target of ``dayzero bench``: streaming OpenAI requests over HTTP (httpx), chat messages to
``/v1/chat/completions`` and everything else to ``/v1/completions``; the queue and cache state after the
run from the server's ``/metrics``.

A request counts as truncated when its stream ends without ``[DONE]``, without a finish reason, or with
fewer completion tokens than asked for (all requests set ``ignore_eos``).
"""
from __future__ import annotations

import asyncio
import json
import os
import time

from dayzero.tools.bench_report import Result
from dayzero.tools.bench_workload import Job

# gauges that must all read 0 once every request has ended
IDLE_GAUGES = ("requests_running", "requests_waiting", "requests_queued", "cache_blocks_used", "state_slots_used")


def _httpx():
    try:
        import httpx
    except ImportError:
        raise ValueError("--url needs the httpx package (pip install httpx)") from None
    return httpx


def target(url: str, api_key: str | None) -> tuple[str, dict]:
    """The server's base address and the request headers: the bearer key given, else $DAYZERO_API_KEY."""
    key = api_key or os.environ.get("DAYZERO_API_KEY")
    return url.rstrip("/"), {"Authorization": f"Bearer {key}"} if key else {}


def served_model(url: str, headers: dict, timeout: float) -> str:
    """The first model the server lists; raises ``ValueError`` naming the option at fault."""
    httpx = _httpx()
    try:
        r = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ValueError(f"--url {url}: cannot reach the server: {type(e).__name__}: {e}") from None
    if r.status_code == 401:
        raise ValueError(f"--api-key: the server at {url} refused it (HTTP 401)")
    try:
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise ValueError(f"--url {url}: GET /v1/models did not list a model ({e})") from None


def body(job: Job, model: str, sampling: dict) -> tuple[str, dict]:
    b = {"model": model, "max_tokens": job.output_len, "stream": True, "stream_options": {"include_usage": True},
         "ignore_eos": True, **sampling}
    if job.messages is not None:
        return "/v1/chat/completions", {**b, "messages": job.messages}
    return "/v1/completions", {**b, "prompt": job.ids if job.ids is not None else job.text}


async def _one(client, job: Job, model: str, sampling: dict) -> tuple[Result, float, float]:
    """One streamed request: its result, and when it was sent and ended (perf_counter)."""
    httpx = _httpx()
    res = Result(job.output_len)
    path, payload = body(job, model, sampling)
    chat = path.endswith("chat/completions")
    chunks, finish, done, last = 0, None, False, None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res, t0, time.perf_counter()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                event = json.loads(line[6:])
                now = time.perf_counter()
                if "error" in event:
                    res.error = str(event["error"].get("message", event["error"]))
                    continue
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                for ch in event.get("choices", ()):
                    if (ch.get("delta", {}).get("content") if chat else ch.get("text")):
                        chunks += 1
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                    finish = ch.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, AttributeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res, t0, time.perf_counter()
    end = time.perf_counter()
    res.e2e = end - t0
    res.output_tokens = res.output_tokens or chunks  # a server that sends no usage: one token per chunk
    res.truncated = not res.error and (not done or finish is None or res.output_tokens != job.output_len)
    return res, t0, end


async def _load(url: str, headers: dict, jobs: list[Job], model: str, sampling: dict, arrivals: list[float],
                concurrency: int | None, timeout: float, progress) -> tuple[list[Result], float]:
    httpx = _httpx()
    cap = concurrency or len(jobs)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    sem = asyncio.Semaphore(cap)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def scheduled(i: int):
            await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            async with sem:
                out = await _one(client, jobs[i], model, sampling)
            progress.update()
            return out

        outs = await asyncio.gather(*(scheduled(i) for i in range(len(jobs))))
    duration = max(end for _, _, end in outs) - min(sent for _, sent, _ in outs)
    return [r for r, _, _ in outs], duration


def run(url: str, headers: dict, jobs: list[Job], model: str, sampling: dict, arrivals: list[float],
        concurrency: int | None, timeout: float, progress) -> tuple[list[Result], float, dict[str, float] | None]:
    """Returns the results in job order, the seconds from the first request sent to the last token, and
    the server's queue and cache gauges once it is idle (None when it has no dayzero ``/metrics``)."""
    results, duration = asyncio.run(_load(url, headers, jobs, model, sampling, arrivals, concurrency, timeout, progress))
    return results, duration, cache_after(url, headers)


def _gauges(url: str, headers: dict) -> dict[str, float] | None:
    from prometheus_client.parser import text_string_to_metric_families

    httpx = _httpx()
    try:
        r = httpx.get(url + "/metrics", headers=headers, timeout=10)
        if r.status_code != 200:
            return None
        found = {s.name: s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
    except (httpx.HTTPError, ValueError):
        return None
    if not all(f"dayzero_{g}" in found for g in IDLE_GAUGES):
        return None
    return {g: found[f"dayzero_{g}"] for g in IDLE_GAUGES}


def cache_after(url: str, headers: dict, wait: float = 10.0) -> dict[str, float] | None:
    """The idle gauges, polled for up to ``wait`` seconds: finished requests free their cache within a step."""
    deadline = time.monotonic() + wait
    while True:
        g = _gauges(url, headers)
        if g is None or not any(g.values()) or time.monotonic() > deadline:
            return g
        time.sleep(0.1)
