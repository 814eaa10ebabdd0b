"""Named training recipes and the data stream a job's options make.

A recipe is the options a documented model was trained with, under one name: ``scripts/train_default.py --recipe
bundled`` trains the bundled model's job (its values become the options' defaults, so a flag given on the command
line still wins). :func:`data_config` turns a job's data options into the :class:`DataConfig` its workers draw
from, for the training script and for ``benchmarks/train_step.py`` alike.
"""
from __future__ import annotations

from dataclasses import replace

from dayzero.eval.tasks import TASKS
from dayzero.train.data import DataConfig

# option name (the training script's, as on its command line) -> value
RECIPES: dict[str, dict] = {
    # dayzero/assets/default: one 15-minute job from scratch, 30 s of it kept for writing the checkpoint and no
    # evaluation in the job (its model card gives the accuracy `dayzero eval` measured after)
    "bundled": {"minutes": 15.0, "copy_warmup": 0.3, "sparse_from": 0.5, "recall_share": 0.5, "recall_min_pairs": 8,
                "chat_share": 0.3, "question_share": 0.6, "loss_parts": "recall=3,copy=2",
                "recall_lengths": "192,1024,8192", "recall_style": "joined", "eval_n": 0, "eval_every": 0.0,
                "eval_seconds": 30.0},
}

# the options that shape the data stream (the rest of a recipe is the schedule's and the evaluation's)
DATA_OPTIONS = ("tasks", "tokens", "recall_share", "copy_warmup", "loss_balance", "loss_parts", "recall_min_pairs",
                "recall_style", "chat_share", "question_share", "recall_questions", "recall_lengths")


def parse_loss_parts(text: str) -> dict[str, float]:
    """``recall=3,copy=2`` -> {"recall": 3.0, "copy": 2.0}; ValueError naming the option when malformed."""
    try:
        parts = {k.strip(): float(v) for k, v in (p.split("=") for p in text.split(","))}
    except ValueError:
        raise ValueError(f"--loss-parts takes TASK=WEIGHT,.., got {text!r}") from None
    bad = sorted(set(parts) - set(TASKS))
    if bad or any(not w > 0 for w in parts.values()):
        raise ValueError(f"--loss-parts: positive weights of the tasks {', '.join(TASKS)}, got {parts}")
    return parts


def parse_tasks(text: str | None) -> list[str]:
    """``addition,recall`` -> the tasks (all of dayzero eval's when None); ValueError naming an unknown one."""
    if text is None:
        return list(TASKS)
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in names if t not in TASKS]
    if bad or not names:
        raise ValueError(f"--tasks: unknown task {', '.join(bad) or '(none given)'}; the tasks are {', '.join(TASKS)}")
    return names


def parse_recall_lengths(text: str) -> tuple[int, int, int]:
    """``192,1024,8192`` -> (MIN, START, MAX) recall prompt lengths; ValueError naming the option when malformed."""
    try:
        lo, start, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--recall-lengths takes MIN,START,MAX token counts, got {text!r}") from None
    if not 0 < lo <= start <= hi:
        raise ValueError(f"--recall-lengths needs 0 < MIN <= START <= MAX, got {text!r}")
    return lo, start, hi


def recipe_data(name: str) -> dict:
    """The data options of recipe ``name``."""
    return {k: v for k, v in RECIPES[name].items() if k in DATA_OPTIONS}


def data_config(*, tasks: str | None = None, tokens: int | None = None, recall_share: float | None = None,
                copy_warmup: float | None = None, loss_balance: str = "task", loss_parts: str | dict | None = None,
                recall_min_pairs: int | None = None, recall_style: str = "letter", chat_share: float | None = None,
                question_share: float | None = None, recall_questions: int | None = None,
                recall_lengths: str | None = None, tiny: bool = False) -> DataConfig:
    """The data stream of a job's options (each None: :class:`DataConfig`'s default); ``tiny`` shrinks the
    instances for CPU smoke runs."""
    data = DataConfig()
    names = parse_tasks(tasks)
    weights = {t: w for t, w in data.weights.items() if t in names}
    share = (recall_share or data.recall_share) if "recall" in names else 0.0
    if not weights:  # recall alone
        share = 0.95
    if isinstance(loss_parts, str):
        loss_parts = parse_loss_parts(loss_parts)
    pick = lambda value, default: default if value is None else value  # noqa: E731
    data = replace(data, weights=weights or {"copy": 1.0}, recall_share=share,
                   tokens=tokens or (2048 if tiny else 98304), copy_warmup=pick(copy_warmup, data.copy_warmup),
                   loss_balance=loss_balance, loss_parts=loss_parts or {},
                   recall_min_pairs=pick(recall_min_pairs, data.recall_min_pairs), recall_style=recall_style,
                   chat_share=pick(chat_share, data.chat_share),
                   question_share=pick(question_share, data.question_share),
                   recall_questions=pick(recall_questions, data.recall_questions))
    if tiny:
        data = replace(data, recall_min=64, recall_start=96, recall_max=160, max_digits=3, max_chars=8, sort_chars=6,
                       copy_words=6)
    if recall_lengths:
        lo, start, hi = parse_recall_lengths(recall_lengths)
        data = replace(data, recall_min=lo, recall_start=start, recall_max=hi)
    return data
