"""``dayzero bench [MODEL] [--url URL]``: throughput and latency of a workload, in-process or against a server.

This file holds the options and the run; the workload is made in ``bench_workload``, sent by
``bench_engine`` (the engine in this process, stepped here) or ``bench_http`` (a server's OpenAI API), and
summed up, tabled and plotted by ``bench_report``. The table comes last, on stdout; the progress bar and
the model line go to stderr.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

from dayzero.tools.bench_report import plot, summarize, table
from dayzero.tools.bench_workload import Job, PromptSource, arrivals, load_dataset, synthetic
from dayzero.tools.cli_errors import describe, usage_errors
from dayzero.tools.cli_options import Help, add_engine_options, engine_kwargs
from dayzero.tools.progress import bar, note

DEFAULT_NUM_PROMPTS = 100
DEFAULT_CONCURRENCY = 16


DESCRIPTION = (
    "Throughput and latency of a workload: synthetic (random token ids or words, fixed or random lengths) or a "
    "JSONL file of prompts, --concurrency requests at a time or Poisson arrivals at --request-rate (both: "
    "arrivals at that rate, at most that many in flight). Every request sets ignore_eos and must produce exactly "
    "its output length; one that ends short counts as truncated. Without --url the engine runs in this process, "
    "stepped token by token; with it the requests stream over the OpenAI API. Exit status 1 when a request failed "
    "or was truncated or the cache is not empty afterwards, 2 on a bad option.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    b = subparsers.add_parser(
        "bench", help="throughput and latency (TTFT, TPOT, ITL percentiles) for a synthetic or file workload",
        description=DESCRIPTION, formatter_class=Help)
    b.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory or config.json (default: the bundled model); with --url only its "
                        "tokenizer and vocabulary are used, to build synthetic prompts")
    t = b.add_argument_group("target")
    t.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000 (default: the engine "
                                               "in this process)")
    t.add_argument("--api-key", default=None, metavar="KEY", help="bearer key for --url (default: $DAYZERO_API_KEY)")
    t.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="model name in requests to --url (default: the first the server lists)")
    t.add_argument("--endpoint", default="auto", choices=["auto", "completions", "chat"],
                   help="auto: chat messages to /v1/chat/completions, prompts to /v1/completions; chat: prompts "
                        "as one user message (in-process too: through the chat template)")
    t.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds per HTTP request")
    w = b.add_argument_group("workload")
    w.add_argument("--dataset", default=None, metavar="FILE",
                   help='JSONL, one request a line: {"messages": [...]} or {"prompt": "..."}, optional "max_tokens"')
    w.add_argument("--num-prompts", type=int, default=None, metavar="N",
                   help=f"requests (default: {DEFAULT_NUM_PROMPTS}, or every line of --dataset; more than it has "
                        "cycles through it)")
    w.add_argument("--input-len", type=int, default=128, metavar="N", help="prompt tokens of synthetic requests")
    w.add_argument("--output-len", type=int, default=128, metavar="N",
                   help="tokens each request generates (--dataset: unless its line has max_tokens)")
    w.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="synthetic lengths uniform in [len*(1-R), len*(1+R)]; 0: fixed")
    w.add_argument("--random-prompt", default="auto", choices=["auto", "ids", "words"],
                   help="synthetic prompts of random token ids (exact length) or words (about as many tokens); "
                        "auto: words for --endpoint chat, else ids")
    w.add_argument("--concurrency", type=int, default=None, metavar="N",
                   help=f"requests in flight at once (default: {DEFAULT_CONCURRENCY}, or unbounded with "
                        "--request-rate)")
    w.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="Poisson arrivals, requests per second (default: all at once)")
    w.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="sampling temperature (default: 0, greedy)")
    add_engine_options(b)  # in-process only; its --seed also seeds the synthetic prompts, lengths and arrivals
    o = b.add_argument_group("output")
    o.add_argument("--json", default=None, metavar="FILE", help="write the summary and per-request numbers as JSON")
    o.add_argument("--plot", default=None, metavar="FILE.png", help="bar chart of the latency percentiles")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    b.set_defaults(func=main, runs_model=True, needs_weights=True)
    return b


def check(args) -> None:
    """Raises ``ValueError`` naming the first bad option."""
    def need(ok: bool, option: str, rule: str, value) -> None:
        if not ok:
            raise ValueError(f"{option} must be {rule}, got {value!r}")

    need(args.num_prompts is None or args.num_prompts >= 1, "--num-prompts", ">= 1", args.num_prompts)
    need(args.input_len >= 1, "--input-len", ">= 1", args.input_len)
    need(args.output_len >= 1, "--output-len", ">= 1", args.output_len)
    need(0 <= args.random_range_ratio < 1, "--random-range-ratio", "in [0, 1)", args.random_range_ratio)
    need(args.concurrency is None or args.concurrency >= 1, "--concurrency", ">= 1", args.concurrency)
    rate = args.request_rate
    need(rate is None or (math.isfinite(rate) and rate > 0), "--request-rate", "> 0 requests/s", rate)
    need(math.isfinite(args.temperature) and args.temperature >= 0, "--temperature", ">= 0", args.temperature)
    need(args.timeout > 0, "--timeout", "> 0 seconds", args.timeout)
    if args.url is not None:
        need(args.url.startswith(("http://", "https://")), "--url", "an http:// or https:// address", args.url)
    if args.dataset is not None and not Path(args.dataset).is_file():
        raise ValueError(f"--dataset {args.dataset}: no such file")


def _local_source(model: str | None) -> PromptSource:
    """Vocabulary and tokenizer from a checkpoint directory, without loading weights (for --url)."""
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.models.registry import adapter_for, read_config

    path = Path(model) if model else DEFAULT_MODEL
    try:
        raw, cfg_file = read_config(path)
        vocab = adapter_for(raw, cfg_file).to_spec(raw).vocab_size
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"MODEL {path}: cannot read its config to build synthetic prompts: {e}") from None
    tok = load_tokenizer(path) if path.is_dir() else None
    return PromptSource(vocab, frozenset(tok.all_special_ids if tok else ()), tok)


def make_jobs(args, source) -> list[Job]:
    """The requests, in the form ``--endpoint`` sends them; ``source`` is called only for synthetic ones."""
    if args.dataset is not None:
        jobs = load_dataset(args.dataset, args.output_len)
        if args.num_prompts is not None:
            jobs = [jobs[i % len(jobs)] for i in range(args.num_prompts)]
    else:
        kind = args.random_prompt if args.random_prompt != "auto" else ("words" if args.endpoint == "chat" else "ids")
        jobs = synthetic(args.num_prompts or DEFAULT_NUM_PROMPTS, args.input_len, args.output_len,
                         args.random_range_ratio, kind, source(), args.seed)
    out = []
    for i, j in enumerate(jobs):
        if args.endpoint == "chat" and j.messages is None:
            if j.text is None:
                raise ValueError(f"--endpoint chat: request {i} is token ids, chat needs text (--random-prompt words)")
            j = Job(j.output_len, messages=[{"role": "user", "content": j.text}])
        if args.endpoint == "completions" and j.messages is not None:
            raise ValueError(f"--endpoint completions: request {i} is chat messages (use --endpoint chat or auto)")
        out.append(j)
    return out


def _progress(args, total: int):
    return bar(total, "bench", enabled=not args.no_progress, unit="req")


def _in_process(args):
    from dayzero import LLM, SamplingParams
    from dayzero.tools import bench_engine

    @functools.cache
    def load():  # after a --dataset is read, before synthetic prompts are made: they need the vocabulary
        llm = LLM(**engine_kwargs(args))
        eng = llm.engine
        note(f"model {eng.path} on {eng.device} in {str(eng.dtype).removeprefix('torch.')}, {eng.num_threads} cpu "
             f"threads; cache {eng.cache_plan.capacity_tokens} tokens")
        return llm

    jobs = make_jobs(args, lambda: bench_engine.prompt_source(load()))
    llm, eng = load(), load().engine
    params = [SamplingParams(max_tokens=j.output_len, temperature=args.temperature, ignore_eos=True) for j in jobs]
    with _progress(args, len(jobs)) as progress:
        results, duration, after = bench_engine.run(llm, jobs, params, arrivals(len(jobs), args.request_rate, args.seed),
                                                    _concurrency(args), progress)
    return jobs, results, duration, after, f"in-process {eng.path.name}"


def _server(args):
    from dayzero.tools import bench_http

    url, headers = bench_http.target(args.url, args.api_key)
    jobs = make_jobs(args, lambda: _local_source(args.model))
    listed = bench_http.served_model(url, headers, min(args.timeout, 30.0))  # also: is it there, is the key right
    model = args.served_model_name or listed
    with _progress(args, len(jobs)) as progress:
        results, duration, after = bench_http.run(url, headers, jobs, model, {"temperature": args.temperature},
                                                  arrivals(len(jobs), args.request_rate, args.seed),
                                                  _concurrency(args), args.timeout, progress)
    return jobs, results, duration, after, f"{url} {model}"


def _concurrency(args) -> int | None:
    if args.concurrency is not None:
        return args.concurrency
    return None if args.request_rate is not None else DEFAULT_CONCURRENCY


def _title(args, n: int, target: str) -> str:
    c = _concurrency(args)
    mode = (f"Poisson {args.request_rate:g} req/s" if args.request_rate else "all at once") + (
        f", concurrency {c}" if c else "")
    if args.dataset is not None:
        work = f"dataset {Path(args.dataset).name}"
    else:
        r = f" (±{args.random_range_ratio:.0%})" if args.random_range_ratio else ""
        work = f"input {args.input_len}{r}, output {args.output_len}{r} tokens"
    return f"{n} requests, {target}, {mode}, {work}"


def main(args) -> int:
    try:
        check(args)
        jobs, results, duration, after, target = (_server if args.url else _in_process)(args)
    except usage_errors() as e:  # an option, a file or a model the user can fix: the command line's one line
        print(f"error: {describe(e)}", file=sys.stderr)
        return 2
    summary = summarize(results, duration, after)
    title = _title(args, len(jobs), target)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key", "no_progress")}
        per_request = [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                        "expected_tokens": r.expected_tokens, "ttft_s": r.ttft, "tpot_s": r.tpot, "e2e_s": r.e2e,
                        "itl_s": r.itl, "truncated": r.truncated, "error": r.error or None} for r in results]
        doc = {"title": title, "config": config, **summary, "per_request": per_request}
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.plot:
        plot(summary, args.plot, title)
    print(table(summary, title))
    bad = summary["requests"]["completed"] < len(results) or summary["cache_empty"] is False
    return 1 if bad else 0
