"""Synthetic tasks with one right answer, generated from a seed: arithmetic, string reversal and sorting,
key–value recall from far back in filler text, and copying a passage.

Every instance is drawn from its own ``random.Random`` seeded by (split, task, seed, index), so the ``eval``
split never replays the ``train`` split's stream and any instance can be regenerated alone. A prompt ends where
the answer starts; the answer is followed by a newline, where generation stops. ``recall`` sizes its filler with
a token counter (the model's tokenizer) so that the prompt is about ``context_len`` tokens long and the key sits
in its first half: more tokens back than a DSA top-k and many KDA chunks.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass
from typing import Callable

SPLITS = ("train", "eval")
# filler and passage words: short, common, one or two tokens each in most vocabularies
WORDS = ("the a of to and in is it for on was with as at by be this from or one had not but what all were when we "
         "there can an your which their said if do will each about how up out them then she many some so these "
         "would other into has more her two like him see time could no make than first been its who now people my "
         "made over did down only way find use may water long little very after words called just where most know "
         "get through back much before go good new write our used me man too any day same right look think also "
         "around another came come work three word must because does part even place well such here take why help "
         "put different away again off went old number great tell men say small every found still between name "
         "should home big give air line set own under read last never us left end along while might next sound "
         "below saw something thought both few those always looked show large often together asked house world "
         "going want school important until form food keep children feet land side without boy once animals life "
         "enough took sometimes four head above kind began almost live page got earth need far hand high year "
         "mother light parts country father let night following picture being study second eyes soon times story "
         "boys since white days ever paper hard near sentence better best across during today others however sure "
         "means knew try told young miles sun ways thing whole hear example heard several change answer room sea "
         "against top turned learn point city play toward five using himself usually").split()


@dataclass(frozen=True)
class Instance:
    task: str
    prompt: str
    answer: str


def _rng(split: str, task: str, seed: int, index: int) -> random.Random:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return random.Random(f"{split}/{task}/{seed}/{index}")


def _number(r: random.Random, max_digits: int) -> int:
    d = r.randint(1, max_digits)
    return r.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1)


def addition(r: random.Random, max_digits: int = 5, **_) -> tuple[str, str]:
    a, b = _number(r, max_digits), _number(r, max_digits)
    return f"{a}+{b}=", str(a + b)


def subtraction(r: random.Random, max_digits: int = 5, **_) -> tuple[str, str]:
    a, b = _number(r, max_digits), _number(r, max_digits)
    return f"{a}-{b}=", str(a - b)


def _letters(r: random.Random, n: int) -> str:
    return "".join(r.choice(string.ascii_lowercase) for _ in range(n))


def reversal(r: random.Random, max_chars: int = 24, **_) -> tuple[str, str]:
    s = _letters(r, r.randint(1, max_chars))
    return f"reverse {s} =", s[::-1]


def sorting(r: random.Random, max_chars: int = 16, **_) -> tuple[str, str]:
    s = _letters(r, r.randint(1, max_chars))
    return f"sort {s} =", "".join(sorted(s))


def copying(r: random.Random, words: int = 32, min_words: int | None = None, **_) -> tuple[str, str]:
    """A passage of ``words`` words (between ``min_words`` and ``words`` when given: training's short copies)."""
    n = words if min_words is None else r.randint(min_words, words)
    passage = " ".join(r.choice(WORDS) for _ in range(n))
    return f"copy: {passage}\n=", passage


RECALL_STYLES = ("letter", "joined", "assign", "sentence")


def _pair(style: str, key: str, value: str) -> str:
    if style == "sentence":
        return f"The value of {key} is {value}."
    return f"{key}{value}." if style == "joined" else f"{key}={value}."


def _question(style: str, key: str) -> str:
    """The text asking for ``key``'s value; the value follows it directly."""
    if style == "sentence":
        return f"\nWhat is the value of {key}? The value of {key} is "
    return f"\nWhat is {key}? {key}" if style == "joined" else f"\nWhat is {key}? {key}="


def recall(r: random.Random, context_len: int = 2048, count: Callable[[str], int] | None = None,
           pairs: int = 8, min_pairs: int | None = None, style: str = "letter", questions: int = 1,
           **_) -> tuple[str, str]:
    """``pairs`` key–value pairs (four-digit values; between ``min_pairs`` and ``pairs`` when given) scattered
    through filler sentences; the question asks for one whose pair sits in the first half of the prompt.
    ``count`` gives a text's length in tokens (default: words, about a token each).

    ``style`` "letter" (the default) writes ``K=1234.`` and ends the prompt with ``K=``, each key one capital letter
    (none occurs in the filler), so that finding the pair takes matching one token, not four: at a tiny size four-letter
    keys stayed at chance where one-letter keys were learnt, and the first H200 run with them is the first whose recall
    formed. "joined" writes ``K1234.`` and ends the prompt with ``K``, the value right after its key: the position
    that predicts the value's first digit holds the key itself, so finding the pair is the one-token match that copying
    uses (multi-query associative recall), where with ``K=`` that position holds the ``=`` every pair shares, and the
    checkpoints trained on it answered another pair's value more often than not. "assign" writes a pair
    ``abcd=1234.`` and ends the prompt with ``abcd=``, so the key's last letters sit right before the value in both
    places (within a short conv's window at byte-level tokens); "sentence" writes ``The value of abcd is 1234.`` and
    ends with ``The value of abcd is `` (the key five tokens and more before the answer: the first checkpoints were
    trained on it).

    ``questions`` > 1 (training's drills): the answer goes on with more questions about other pairs, each with
    its value, ``1234\nWhat is efgh? efgh=5678``, up to one per pair: several retrievals from one prompt. The
    instance's first question and everything before it are drawn as with one question."""
    if style not in RECALL_STYLES:
        raise ValueError(f"recall style must be one of {RECALL_STYLES}, got {style!r}")
    count = count or (lambda text: len(text.split()))
    n_pairs = pairs if min_pairs is None else r.randint(min_pairs, pairs)
    entries, seen = [], set()  # (key, value)
    while len(entries) < n_pairs:
        k = r.choice(string.ascii_uppercase) if style in ("letter", "joined") else _letters(r, 4)
        if k not in seen:
            seen.add(k)
            entries.append((k, f"{r.randint(0, 9999):04d}"))
    asked = r.randrange(len(entries))
    sentence = lambda: " ".join(r.choice(WORDS) for _ in range(12)) + "."  # noqa: E731
    question = _question(style, entries[asked][0])
    facts = [_pair(style, k, v) for k, v in entries]
    per = count(" ".join(sentence() for _ in range(64))) / 64  # tokens per filler sentence, joined as below
    reserve = count(question) + count(" ".join(facts))
    n = max(0, int((context_len - reserve) / per))  # no filler at all in the shortest (training) prompts
    filler = [sentence() for _ in range(n)]
    # the asked pair in the first half, the others anywhere
    spots = {asked: r.randrange(0, max(1, n // 2))}
    for i in range(len(entries)):
        spots.setdefault(i, r.randrange(0, n) if n else 0)
    for i, at in sorted(spots.items(), key=lambda kv: -kv[1]):
        filler.insert(at, facts[i])
    answer = entries[asked][1]
    others = [i for i in range(len(entries)) if i != asked]
    for i in r.sample(others, min(questions - 1, len(others))):
        answer += _question(style, entries[i][0]) + entries[i][1]
    return " ".join(filler) + question, answer


QUESTION_TASKS = ("addition", "subtraction")
_OPERATION = re.compile(r"^(\d+)([+-])(\d+)=$")


def as_question(inst: Instance) -> Instance:
    """An arithmetic instance asked as a person would ask it in a chat, ``What is 48213 + 3771?`` for
    ``48213+3771=``, with the same answer; other tasks' instances unchanged."""
    m = _OPERATION.match(inst.prompt) if inst.task in QUESTION_TASKS else None
    if m is None:
        return inst
    a, op, b = m.groups()
    return Instance(inst.task, f"What is {a} {op} {b}?", inst.answer)


TASKS: dict[str, Callable[..., tuple[str, str]]] = {
    "addition": addition, "subtraction": subtraction, "reversal": reversal, "sorting": sorting,
    "recall": recall, "copy": copying,
}


def instances(task: str, n: int, split: str = "eval", seed: int = 0, **options) -> list[Instance]:
    """``n`` instances of ``task`` from the ``split`` stream; ``options`` go to the generator (e.g. max_digits,
    context_len and count for recall)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; the tasks are {', '.join(TASKS)}")
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    gen = TASKS[task]
    return [Instance(task, *gen(_rng(split, task, seed, i), **options)) for i in range(n)]
