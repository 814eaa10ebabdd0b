"""Held-out accuracy of a saved checkpoint through the real engine (``dayzero.LLM``), as ``dayzero eval``
scores it: the eval split's instances, greedy decoding stopped at the newline, exact match."""
from __future__ import annotations

from types import SimpleNamespace

from dayzero.eval.modes import engine_session
from dayzero.eval.tasks import TASKS
from dayzero.tools import eval_cli


def evaluate(path, n: int = 100, tasks=tuple(TASKS), context_len: int = 2048, max_digits: int = 5,
             task_seed: int = 0, device: str = "auto", recall_style: str = "letter", **engine) -> list[dict]:
    """Rows of ``eval_cli.score`` (task, n, correct, accuracy, 95% interval, characters in place) for the
    checkpoint at ``path`` (``eval_cli.table`` prints them); ``engine`` goes to ``LLM`` (e.g. ``enforce_eager``,
    ``cache_memory_bytes``)."""
    args = SimpleNamespace(tasks=",".join(tasks), n=n, task_seed=task_seed, max_digits=max_digits,
                           context_len=context_len, recall_style=recall_style, url=None, format="plain")
    eval_cli.check_options(args)
    with engine_session(model=str(path), device=device, **engine) as llm:
        insts = eval_cli.build(args, llm.tokenizer)
        return eval_cli.score(insts, eval_cli.answers(llm, insts))

