"""The model card a training run writes beside its checkpoint (``README.md``): what the model is, what it was
trained on and how (the command, the time, the steps), and its held-out accuracy as ``dayzero eval`` scores it.

The front matter holds the accuracy as one line of JSON (``dayzero_eval: {...}``, which is also YAML), so a test
or a tool can compare a later evaluation with the card's numbers (:func:`card_results`).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

_RESULTS = re.compile(r"^dayzero_eval: (\{.*\})$", re.MULTILINE)


def _training(command: str, device: str, summary: dict) -> str:
    """The Training section of one job: its command, device, steps, tokens, time and last loss."""
    last = summary["history"][-1]["loss"] if summary.get("history") else float("nan")
    rate = summary["tokens"] / max(summary["seconds"], 1e-9)
    return (f"`{command}` on {device}: {summary['steps']} steps, {summary['tokens'] / 1e6:.1f}M tokens in "
            f"{summary['seconds']:.0f} s ({rate / 1e3:,.0f}K tokens/s); last logged loss on the answer tokens "
            f"{last:.4f}. How: `docs/training.md`.")


def model_card(*, config, n_params: int, size_bytes: int, expert_format: str, tasks: list[str], rows: list[dict],
               eval_setup: dict, command: str = "", device: str = "", summary: dict | None = None,
               signal_rows: list[dict] | None = None, training: str | None = None) -> str:
    """The card's text. ``summary``: the trainer's (steps, tokens, seconds, history); ``rows``: ``eval_cli.score``
    rows (may be empty); ``eval_setup``: how they were measured (device, dtype, n, context_len, ...);
    ``signal_rows``: the rows of :mod:`dayzero.eval.signal`'s subset (fp32, CPU), which CI scores again;
    ``training``: the Training section's text, given instead of ``command``, ``device`` and ``summary`` (a model
    trained over several jobs)."""
    from dayzero.eval.signal import SIGNAL_CONTEXT, SIGNAL_SEED, signal_accuracy

    results = {**eval_setup, "accuracy": {r["task"]: round(r["accuracy"], 4) for r in rows}}
    if signal_rows:
        results["signal"] = signal_accuracy(signal_rows)
    kinds = ", ".join(f"{config.layer_types.count(k)} {k.upper()}" for k in dict.fromkeys(config.layer_types))
    lines = [
        "---",
        "library_name: dayzero",
        "tags: [dayzero_hybrid, synthetic-tasks]",
        f"dayzero_eval: {json.dumps(results, sort_keys=True)}",
        "---",
        "",
        "# dayzero default model",
        "",
        f"A `dayzero_hybrid` of {n_params / 1e6:.1f}M parameters: hidden {config.hidden_size}, "
        f"{config.num_hidden_layers} layers ({kinds}), LatentMoE with {config.n_routed_experts} routed experts "
        f"(top-{config.num_experts_per_tok}) and a shared expert, routed experts stored as "
        f"{'MXFP4' if expert_format == 'mxfp4' else 'bf16'}; `model.safetensors` {size_bytes / 2**20:.1f} MiB. "
        "A byte-level tokenizer and a chat template.",
        "",
        f"Trained on the synthetic tasks of `dayzero eval` (train split only): {', '.join(tasks)}.",
        "",
        "## Training",
        "",
        (training or "").strip().removeprefix("## Training").strip() or _training(command, device, summary),
        "",
        "## Held-out accuracy",
        "",
    ]
    if rows:
        setup = ", ".join(f"{k} {v}" for k, v in eval_setup.items())
        lines += [f"Exact match, greedy, eval split ({setup}):", "",
                  "| task | n | correct | accuracy | 95% interval | answer characters in place |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['task']} | {r['n']} | {r['correct']} | {r['accuracy']:.1%} | {r['low']:.1%} – "
                  f"{r['high']:.1%} | {r['chars']:.1%} |" for r in rows]
        lines += ["", "Score it again with `dayzero eval MODEL --n N --context-len L`."]
    else:
        lines += ["Not evaluated in this run: `dayzero eval MODEL` scores it."]
    if signal_rows:
        lines += ["", "## The signal subset", "",
                  f"The seeded subset of `dayzero/eval/signal.py` (eval split, seed {SIGNAL_SEED}, recall at "
                  f"{SIGNAL_CONTEXT} tokens), fp32 on a CPU; `tests/eval/test_card.py` scores it again through "
                  "engines of other precisions and caches and holds them to these numbers:", "",
                  "| task | n | correct | accuracy |", "|---|---|---|---|"]
        lines += [f"| {r['task']} | {r['n']} | {r['correct']} | {r['accuracy']:.1%} |" for r in signal_rows]
        total, n = sum(r["correct"] for r in signal_rows), sum(r["n"] for r in signal_rows)
        lines += [f"| all | {n} | {total} | {total / n:.1%} |"]
    return "\n".join(lines) + "\n"


def write_model_card(out: str | Path, **fields) -> Path:
    path = Path(out) / "README.md"
    path.write_text(model_card(**fields))
    return path


def card_results(path: str | Path) -> dict:
    """The ``dayzero_eval`` results of the card in checkpoint directory ``path`` (or of the file itself)."""
    p = Path(path)
    text = (p / "README.md" if p.is_dir() else p).read_text()
    found = _RESULTS.search(text)
    if found is None:
        raise ValueError(f"{p}: no dayzero_eval line in the model card's front matter")
    return json.loads(found.group(1))


def trained_recall_style(path: str | Path, default: str = "letter") -> str:
    """How the checkpoint in ``path`` was taught recall prompts: the ``recall_style`` its card records, else
    ``default`` (no card, or a card from before the styles)."""
    try:
        return card_results(path).get("recall_style", default)
    except (OSError, ValueError):
        return default
