"""What ``dayzero bench`` sends: synthetic prompts or a file of them, each with its output length, and when.

A :class:`Job` holds one request's prompt in exactly one form (token ids, text or chat messages) and the
number of tokens it must generate. Synthetic token-id prompts have exactly their input length; text built
from words is as long as the tokenizer makes it (the report counts the real prompt tokens).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# a few multi-byte words, so that text prompts exercise incremental detokenization
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu",
         "model", "token", "cache", "expert", "layer", "stream", "你好", "😀")


@dataclass
class Job:
    output_len: int
    ids: list[int] | None = None
    text: str | None = None
    messages: list[dict] | None = None


@dataclass(frozen=True)
class PromptSource:
    """What synthetic prompts are drawn from: the model's vocabulary (minus special tokens) and its
    tokenizer, which counts the tokens of word prompts (None: a word counts as a token)."""

    vocab_size: int
    special_ids: frozenset[int]
    tokenizer: object | None


def lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    """``n`` lengths uniform in [mean·(1−ratio), mean·(1+ratio)]; all equal to ``mean`` when ratio is 0."""
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n_tokens: int, tokenizer) -> str:
    words = [rng.choice(WORDS)]
    if tokenizer is None:
        words += [rng.choice(WORDS) for _ in range(n_tokens - 1)]
        return " ".join(words)
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens:
        words.append(rng.choice(WORDS))
    return " ".join(words)


def synthetic(n: int, input_len: int, output_len: int, ratio: float, kind: str, source: PromptSource,
              seed: int) -> list[Job]:
    """``kind`` "ids": random token ids, exactly the input length; "words": random words, about as many
    tokens (at most one word more)."""
    rng = random.Random(seed)
    ins, outs = lengths(rng, n, input_len, ratio), lengths(rng, n, output_len, ratio)
    allowed = [t for t in range(source.vocab_size) if t not in source.special_ids]
    jobs = []
    for n_in, n_out in zip(ins, outs):
        if kind == "ids":
            jobs.append(Job(n_out, ids=[rng.choice(allowed) for _ in range(n_in)]))
        else:
            jobs.append(Job(n_out, text=_words(rng, n_in, source.tokenizer)))
    return jobs


def load_dataset(path: str, output_len: int) -> list[Job]:
    """JSONL, one request a line: ``{"messages": [...]}`` or ``{"prompt": "..." | [token ids]}``, with an
    optional ``"max_tokens"`` (default ``output_len``). Blank lines are skipped. Raises ``ValueError``
    naming the option, the file and the line."""
    where = f"--dataset {path}"
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: cannot read it: {e}") from None
    jobs = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            jobs.append(_job(json.loads(line), output_len))
        except (json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"{where} line {no}: {e}") from None
    if not jobs:
        raise ValueError(f"{where}: no requests in it")
    return jobs


def _job(item, output_len: int) -> Job:
    if not isinstance(item, dict):
        raise ValueError(f"expected an object with 'messages' or 'prompt', got {type(item).__name__}")
    n_out = item.get("max_tokens", output_len)
    if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {n_out!r}")
    if "messages" in item:
        msgs = item["messages"]
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        return Job(n_out, messages=msgs)
    prompt = item.get("prompt")
    if isinstance(prompt, str) and prompt:
        return Job(n_out, text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return Job(n_out, ids=prompt)
    raise ValueError("needs 'messages' (a list) or 'prompt' (a non-empty string or list of token ids)")


def arrivals(n: int, rate: float | None, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: all at once without a rate, else a
    Poisson process (exponential gaps), the first at 0."""
    if rate is None:
        return [0.0] * n
    rng, t, out = random.Random(seed + 1), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
