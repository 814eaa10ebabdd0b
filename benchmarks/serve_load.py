"""Bounded load test of a running ``dayzero serve`` (or one it starts itself) over loopback.

Sends a fixed number of streaming requests, either at a fixed concurrency or arriving as a Poisson process
at a given rate, and stops by itself. Reports request and output-token throughput, TTFT, TPOT (mean time per
output token after the first, per request), ITL (gap between consecutive streamed chunks) and end-to-end
latency at p50/p90/p99, plus failed and truncated requests, and checks that the cache is empty afterwards.

    python benchmarks/serve_load.py --launch --num-requests 200 --concurrency 16
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --request-rate 20 --api-key KEY
    python benchmarks/serve_load.py --in-process --num-requests 200 --concurrency 16   # the engine alone

Every request sets ``ignore_eos`` so that it generates exactly its ``max_tokens``: a stream that ends with
fewer tokens, without a finish reason or without ``[DONE]`` counts as truncated.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class Result:
    ok: bool = False
    truncated: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


def make_jobs(args) -> list[tuple[str, int]]:
    rng = random.Random(args.seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "你好", "😀"]
    jobs = []
    for _ in range(args.num_requests):
        n_words = rng.randint(*args.prompt_words)
        jobs.append((" ".join(rng.choice(words) for _ in range(n_words)), rng.randint(*args.max_tokens)))
    return jobs


async def one(client: httpx.AsyncClient, args, model: str, prompt: str, max_tokens: int) -> Result:
    res = Result()
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "temperature": 1.0}
    if args.endpoint == "chat":
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    t0 = time.perf_counter()
    last = None
    finish, done = None, False
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"]["message"]
                    continue
                now = time.perf_counter()
                if event.get("usage"):
                    res.prompt_tokens = event["usage"]["prompt_tokens"]
                    res.output_tokens = event["usage"]["completion_tokens"]
                for ch in event["choices"]:
                    text = ch.get("text") if args.endpoint == "completions" else ch.get("delta", {}).get("content")
                    if text:
                        if res.ttft is None:
                            res.ttft = now - t0
                        elif last is not None:
                            res.itl.append(now - last)
                        last = now
                    finish = ch.get("finish_reason") or finish
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.truncated = not res.error and (not done or finish is None or res.output_tokens != max_tokens)
    res.ok = not res.error and not res.truncated
    return res


async def run_load(args, url: str, headers: dict) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=max(args.concurrency or 0, 256), max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        jobs = make_jobs(args)
        t0 = time.perf_counter()
        if args.request_rate:
            rng = random.Random(args.seed + 1)
            tasks = []
            for prompt, m in jobs:  # Poisson arrivals: exponential gaps
                tasks.append(asyncio.create_task(one(client, args, model, prompt, m)))
                await asyncio.sleep(rng.expovariate(args.request_rate))
            results = await asyncio.gather(*tasks)
        else:
            sem = asyncio.Semaphore(args.concurrency)

            async def bounded(prompt, m):
                async with sem:
                    return await one(client, args, model, prompt, m)

            results = await asyncio.gather(*(bounded(p, m) for p, m in jobs))
        return list(results), time.perf_counter() - t0


def cache_state(url: str, headers: dict) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    want = ("dayzero_requests_running", "dayzero_requests_waiting", "dayzero_cache_blocks_used", "dayzero_state_slots_used")
    return {k: float(line.split()[-1]) for line in text.splitlines() for k in want if line.startswith(k + " ")}


def report(args, results: list[Result], duration: float, after: dict[str, float]) -> str:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    rows = [
        ("requests (ok / failed / truncated)",
         f"{len(ok)} / {sum(bool(r.error) for r in results)} / {sum(r.truncated for r in results)}"),
        ("duration (s)", f"{duration:.2f}"),
        ("request throughput (req/s)", f"{len(ok) / duration:.2f}"),
        ("output token throughput (tok/s)", f"{out_tokens / duration:.1f}"),
        ("total token throughput (tok/s)", f"{(out_tokens + sum(r.prompt_tokens for r in ok)) / duration:.1f}"),
    ]
    series = {
        "TTFT (ms)": [r.ttft for r in ok if r.ttft is not None],
        "TPOT (ms)": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1],
        "ITL (ms)": [x for r in ok for x in r.itl],
        "E2E latency (ms)": [r.e2e for r in ok],
    }
    for name, values in series.items():
        if values:
            p50, p90, p99 = np.percentile(np.array(values) * 1000, [50, 90, 99])
            rows.append((f"{name} p50 / p90 / p99", f"{p50:.1f} / {p90:.1f} / {p99:.1f}"))
    rows.append(("cache after the run", "empty" if after and not any(after.values()) else f"NOT EMPTY {after}"))
    width = max(len(k) for k, _ in rows)
    mode = f"Poisson {args.request_rate} req/s" if args.request_rate else f"concurrency {args.concurrency}"
    lines = [f"{args.num_requests} {args.endpoint} requests, {mode}, prompt {args.prompt_words[0]}-{args.prompt_words[1]} "
             f"words, max_tokens {args.max_tokens[0]}-{args.max_tokens[1]}", "-" * (width + 24)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    errors = sorted({r.error for r in results if r.error})
    lines += [f"error: {e}" for e in errors[:5]]
    return "\n".join(lines)


def in_process(args) -> str:
    """The same prompts and lengths through ``LLM.generate``, ``concurrency`` sequences at a time: the
    engine without the server, for comparison."""
    from dayzero import LLM, SamplingParams

    llm = LLM(args.launch_model, max_num_seqs=args.concurrency)
    jobs = make_jobs(args)
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in jobs], [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True)
                                               for _, m in jobs])
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return (f"{len(jobs)} prompts through LLM.generate, {args.concurrency} at a time: {dt:.2f} s, "
            f"{len(jobs) / dt:.2f} req/s, {n_out / dt:.1f} output tok/s")


def launch(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dayzero.cli", "serve", *([args.launch_model] if args.launch_model else []),
           "--port", str(port), *args.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready")


def int_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("DAYZERO_API_KEY"))
    ap.add_argument("--model", default=None, help="default: the server's only model")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals at this rate instead of fixed concurrency")
    ap.add_argument("--prompt-words", type=int_range, default=(4, 64), help="range, e.g. 4-64")
    ap.add_argument("--max-tokens", type=int_range, default=(16, 128), help="range, e.g. 16-128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--launch", action="store_true", help="start `dayzero serve` on a free loopback port and stop it after")
    ap.add_argument("--launch-model", default=None, help="checkpoint for --launch (default: the bundled model)")
    ap.add_argument("--server-args", default="", help="extra `dayzero serve` arguments for --launch")
    ap.add_argument("--in-process", action="store_true",
                    help="no server: run the same workload through LLM.generate (--launch-model) for comparison")
    args = ap.parse_args(argv)
    if args.in_process:
        print(in_process(args))
        return 0

    proc, url = launch(args) if args.launch else (None, args.url.rstrip("/"))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        results, duration = asyncio.run(run_load(args, url, headers))
        deadline = time.monotonic() + 10  # aborts and finishes land within a step or two
        after = cache_state(url, headers)
        while any(after.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
            after = cache_state(url, headers)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    print(report(args, results, duration, after))
    bad = any(not r.ok for r in results) or any(after.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
