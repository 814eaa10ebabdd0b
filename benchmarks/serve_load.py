"""Bounded load test of ``dayzero serve`` over loopback: a thin wrapper over ``dayzero bench``.

Adds what the bench command leaves to the caller: starting a server on a free port and stopping it after
(``--launch``), and this benchmark's own workload, kept so that runs stay comparable with the recorded
ones: prompts of a random number of words (``--prompt-words``) and a random ``max_tokens`` per request,
sampled at temperature 1. The workload goes to ``dayzero bench`` as a ``--dataset`` file; any option this
script does not know (``--json``, ``--plot``, ...) is passed on to it.

    python benchmarks/serve_load.py --launch --num-requests 200 --concurrency 16
    python benchmarks/serve_load.py --url http://127.0.0.1:8000 --request-rate 20 --api-key KEY
    python benchmarks/serve_load.py --in-process --num-requests 200 --concurrency 16   # the engine alone

The same measurement with a synthetic workload, straight from the command line:
``dayzero bench --url http://127.0.0.1:8000 --num-prompts 200 --concurrency 16``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dayzero.tools.bench import add_parser, main as bench_main
from dayzero.tools.cli_options import CommandParser, Parser

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "你好", "😀"]


def write_workload(path: Path, num: int, words: tuple[int, int], max_tokens: tuple[int, int], seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(num):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
            f.write(json.dumps({"prompt": prompt, "max_tokens": rng.randint(*max_tokens)}, ensure_ascii=False) + "\n")


def launch(model: str | None, server_args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "dayzero.cli", "serve", *([model] if model else []), "--port", str(port),
           *server_args.split()]
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


def run_bench(argv: list[str]) -> int:
    ap = Parser(prog="dayzero")
    add_parser(ap.add_subparsers(parser_class=CommandParser))
    return bench_main(ap.parse_args(["bench", *argv]))


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
                    help="no server: the same workload through the engine in this process (--launch-model)")
    args, passthrough = ap.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "workload.jsonl"
        write_workload(dataset, args.num_requests, args.prompt_words, args.max_tokens, args.seed)
        bench = ["--dataset", str(dataset), "--endpoint", args.endpoint, "--temperature", "1.0",
                 "--seed", str(args.seed), "--timeout", str(args.timeout)]
        if args.request_rate:  # as before: Poisson arrivals with no bound on the requests in flight
            bench += ["--request-rate", str(args.request_rate)]
        else:
            bench += ["--concurrency", str(args.concurrency)]
        if args.in_process:
            return run_bench([*([args.launch_model] if args.launch_model else []), *bench, *passthrough])
        proc, url = launch(args.launch_model, args.server_args) if args.launch else (None, args.url.rstrip("/"))
        bench += ["--url", url, *(["--api-key", args.api_key] if args.api_key else []),
                  *(["--served-model-name", args.model] if args.model else [])]
        try:
            return run_bench([*bench, *passthrough])
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)


if __name__ == "__main__":
    sys.exit(main())
