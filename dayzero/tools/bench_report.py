"""Per-request measurements of ``dayzero bench`` and what they add up to: the summary, its table, its plot.

TTFT: from the request's arrival to its first token. TPOT: per request, the time after the first token
divided by the tokens after it. ITL: the gaps between consecutive token arrivals (a streamed chunk, or an
engine step that gave the request a token). E2E: arrival to the last token. Only requests that produced
exactly their output length count in the latencies and throughputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SERIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


@dataclass
class Result:
    expected_tokens: int
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str = ""
    truncated: bool = False  # ended without error but short of its output length

    @property
    def ok(self) -> bool:
        return not self.error and not self.truncated

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _stats(seconds: list[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ms = np.asarray(seconds) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(ms, PERCENTILES))}}


def summarize(results: list[Result], duration: float, cache_after: dict[str, float] | None) -> dict:
    """The numbers the table, ``--json`` and ``--plot`` show. ``cache_after`` None: not known."""
    ok = [r for r in results if r.ok]
    prompt, output = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    per = max(duration, 1e-9)
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [x for r in ok for x in r.itl],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    return {
        "requests": {"total": len(results), "completed": len(ok), "failed": sum(bool(r.error) for r in results),
                     "truncated": sum(r.truncated and not r.error for r in results)},
        "duration_s": duration,
        "tokens": {"prompt": prompt, "output": output, "expected_output": sum(r.expected_tokens for r in results)},
        "throughput": {"requests_per_s": len(ok) / per, "output_tokens_per_s": output / per,
                       "total_tokens_per_s": (prompt + output) / per},
        "latency_ms": {name: _stats(v) for name, v in series.items()},
        "cache_after": cache_after,
        "cache_empty": None if cache_after is None else not any(cache_after.values()),
        "errors": sorted({r.error for r in results if r.error})[:20],
    }


def table(summary: dict, title: str) -> str:
    req, tok, thr = summary["requests"], summary["tokens"], summary["throughput"]
    rows = [
        ("requests (ok / failed / truncated)", f"{req['completed']} / {req['failed']} / {req['truncated']}"),
        ("duration (s)", f"{summary['duration_s']:.2f}"),
        ("prompt / output tokens", f"{tok['prompt']} / {tok['output']}"),
        ("request throughput (req/s)", f"{thr['requests_per_s']:.2f}"),
        ("output token throughput (tok/s)", f"{thr['output_tokens_per_s']:.1f}"),
        ("total token throughput (tok/s)", f"{thr['total_tokens_per_s']:.1f}"),
    ]
    head = ("latency (ms)", "mean / p50 / p90 / p99")
    lat = [(f"{label} (ms)", " / ".join(f"{s[k]:.1f}" for k in ("mean", "p50", "p90", "p99")) if s else "-")
           for (name, label) in SERIES for s in [summary["latency_ms"][name]]]
    empty = summary["cache_empty"]
    cache = "unknown" if empty is None else "empty" if empty else f"NOT EMPTY {summary['cache_after']}"
    width = max(len(k) for k, _ in rows + lat + [head])
    lines = [title, "-" * (width + 30)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows + [head] + lat + [("cache after the run", cache)]]
    lines += [f"error: {e}" for e in summary["errors"][:5]]
    return "\n".join(lines)


def plot(summary: dict, path: str, title: str) -> None:
    """p50/p90/p99 of each latency, one panel each (their scales differ by orders of magnitude)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SERIES), figsize=(3.2 * len(SERIES), 3.4))
    for ax, (name, label) in zip(axes, SERIES):
        s = summary["latency_ms"][name]
        values = [s[f"p{p}"] for p in PERCENTILES] if s else [0.0] * len(PERCENTILES)
        ax.bar([f"p{p}" for p in PERCENTILES], values, color=["#4c72b0", "#dd8452", "#c44e52"])
        ax.set_title(label)
        ax.set_ylabel("ms")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
