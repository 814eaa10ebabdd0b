"""The end-to-end signal: a seeded subset of held-out instances whose accuracy the bundled model's card records
and CI scores again through engines that differ in precision, cache storage and scheduling.

Short prompts (five-digit arithmetic, strings of up to 24 characters, recall at 384 tokens), so that the subset
runs in seconds per engine on a CPU, from the eval split's seed stream (never seen in training).
"""
from __future__ import annotations

from collections.abc import Callable

from dayzero.eval.tasks import Instance, instances

SIGNAL_TASKS = (("addition", 50), ("subtraction", 50), ("reversal", 50), ("sorting", 50), ("recall", 20))
SIGNAL_SEED = 11
SIGNAL_CONTEXT = 384  # recall prompts' tokens


def signal_instances(count: Callable[[str], int], recall_style: str = "letter") -> list[Instance]:
    """The subset, in a fixed order; ``count(text)`` is a text's tokens under the model's tokenizer, recall pairs
    written in ``recall_style`` (the model's, as its card records: ``trained_recall_style``)."""
    out = []
    for task, n in SIGNAL_TASKS:
        out += instances(task, n, "eval", seed=SIGNAL_SEED, max_digits=5, context_len=SIGNAL_CONTEXT, count=count,
                         style=recall_style)
    return out


def signal_accuracy(rows: list[dict]) -> dict[str, float]:
    """Per task and in total (``"all"``), the share of exact answers, from ``eval_cli.score`` rows."""
    out = {r["task"]: round(r["accuracy"], 4) for r in rows}
    out["all"] = round(sum(r["correct"] for r in rows) / max(1, sum(r["n"] for r in rows)), 4)
    return out
