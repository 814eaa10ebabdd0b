"""Training data: the synthetic tasks of :mod:`dayzero.eval.tasks` (the ``train`` split only, so no held-out
instance is trained on), tokenized by the checkpoint's tokenizer and packed into one step's sequences.

Every instance is one fresh sequence, in one of two formats, the loss on the answer tokens only:

- plain, as ``dayzero eval`` prompts the model: ``prompt`` then ``answer`` ``"\\n"`` EOS;
- chat, through the checkpoint's chat template: ``<|bos|><|user|>prompt<|end|><|assistant|>`` then ``answer``
  ``<|end|>`` (the end-of-turn token the engine stops a chat at).

A step holds about ``tokens`` tokens: ``recall_share`` of them key-value recall prompts, the rest the short
tasks drawn by ``weights``. The recall context lengths follow a curriculum: uniform between ``recall_min`` and
a bound growing from ``recall_start`` to ``recall_max`` over the first ``recall_ramp`` of training. Training's
copies and recall prompts also come small (from ``copy_min_words`` words, from ``recall_min_pairs`` key-value
pairs), where retrieval is easiest to learn; the eval split keeps the full sizes.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from dayzero.eval.tasks import QUESTION_TASKS, RECALL_STYLES, TASKS, Instance, as_question, instances
from dayzero.engine.tokenizer import chat_end_of_turn_ids

IGNORE = -100  # target of a row whose next token is not an answer token


@dataclass(frozen=True)
class DataConfig:
    tokens: int = 65536  # tokens per step
    weights: dict[str, float] = field(default_factory=lambda: {
        "addition": 0.3, "subtraction": 0.25, "reversal": 0.17, "sorting": 0.13, "copy": 0.15})
    recall_share: float = 0.4  # of the step's tokens
    recall_min: int = 128
    recall_start: int = 384
    recall_max: int = 2560
    recall_ramp: float = 0.5  # fraction of training over which the recall bound grows
    chat_share: float = 0.2
    # of the chat-format addition and subtraction instances, the share asked in words ("What is 48213 + 3771?",
    # dayzero.eval.tasks.as_question) instead of in the plain format's "48213+3771="
    question_share: float = 0.5
    max_digits: int = 5
    max_chars: int = 24  # reversal
    sort_chars: int = 16
    copy_words: int = 32
    # retrieval from short instances first: copies of copy_min_words..copy_words words, recall prompts holding
    # recall_min_pairs..8 pairs (the eval split keeps 32 words and 8 pairs)
    copy_min_words: int = 4
    recall_min_pairs: int = 2
    # how a pair is written (dayzero.eval.tasks.recall): "letter", K=1234, a key of one token (the fifth run's
    # format, the first whose recall formed); "joined", K1234, the value right after its key; "assign", abcd=1234,
    # and "sentence" for the earlier runs' formats
    recall_style: str = "letter"
    # questions per plain-format recall prompt (dayzero.eval.tasks.recall's drills): each asked pair's value is a
    # retrieval the loss sees; a single question gives ~4 answer tokens a prompt of hundreds
    recall_questions: int = 4
    # copying first: over the first ``copy_warmup`` of training, ``copy_warmup_share`` of the non-recall tokens are
    # copies (the other tasks keep their proportions in the rest), so that a copying (induction) mechanism forms
    # before the other tasks' gradients dominate; a run that mixed the tasks from the start formed none
    copy_warmup: float = 0.5
    copy_warmup_share: float = 0.8
    # the LM loss: "task" gives each task of a step an equal part (the mean over its answer tokens), "token" a
    # part by its answer tokens; a recall prompt has ~6 answer tokens in hundreds, so per token recall was ~1% of
    # the loss at 40% of the tokens, and a 968-step run learnt no recall even at 200 tokens of context
    loss_balance: str = "task"
    # with loss_balance "task": a task's part of the loss relative to the others' (default 1 each), e.g. more for
    # recall in a continuation whose arithmetic is already exact
    loss_parts: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        bad = sorted(set(self.weights) - set(TASKS))
        if bad:
            raise ValueError(f"unknown task {', '.join(bad)}; the tasks are {', '.join(TASKS)}")
        if "recall" in self.weights:
            raise ValueError("recall takes its share of tokens from recall_share, not from weights")
        if self.tokens < 64:
            raise ValueError(f"tokens per step must be at least 64, got {self.tokens}")
        if not 0 <= self.recall_share < 1 or not 0 <= self.chat_share <= 1 or not 0 <= self.question_share <= 1:
            raise ValueError("recall_share must be in [0, 1), chat_share and question_share in [0, 1]")
        if not 1 <= self.recall_min_pairs <= 8 or self.copy_min_words < 1:
            raise ValueError("recall_min_pairs must be in [1, 8] and copy_min_words at least 1")
        if self.recall_questions < 1:
            raise ValueError(f"recall_questions must be at least 1, got {self.recall_questions}")
        if self.recall_style not in RECALL_STYLES:
            raise ValueError(f"recall_style must be one of {RECALL_STYLES}, got {self.recall_style!r}")
        if not 0 < self.recall_min <= self.recall_start <= self.recall_max:
            raise ValueError("recall lengths must satisfy 0 < recall_min <= recall_start <= recall_max")
        if self.loss_balance not in ("task", "token"):
            raise ValueError(f"loss_balance must be 'task' or 'token', got {self.loss_balance!r}")
        bad = sorted(set(self.loss_parts) - set(TASKS))
        if bad or any(not v > 0 for v in self.loss_parts.values()):
            raise ValueError(f"loss_parts takes positive weights of the tasks {', '.join(TASKS)}, got {self.loss_parts}")
        if not 0 <= self.copy_warmup <= 1 or not 0 <= self.copy_warmup_share < 1:
            raise ValueError("copy_warmup must be in [0, 1] and copy_warmup_share in [0, 1)")

    def recall_bound(self, progress: float) -> int:
        ramp = min(1.0, progress / self.recall_ramp) if self.recall_ramp > 0 else 1.0
        return int(self.recall_start + ramp * (self.recall_max - self.recall_start))

    def weights_at(self, progress: float) -> dict[str, float]:
        """The non-recall tasks' token shares at this fraction of training (summing to 1)."""
        total = sum(self.weights.values())
        shares = {t: w / total for t, w in self.weights.items()}
        if progress >= self.copy_warmup or "copy" not in shares or len(shares) == 1:
            return shares
        others = 1 - shares["copy"]
        keep = (1 - self.copy_warmup_share) / others if others > 0 else 0.0
        return {t: self.copy_warmup_share if t == "copy" else w * keep for t, w in shares.items()}

    def options(self, task: str) -> dict:
        return {"addition": {"max_digits": self.max_digits}, "subtraction": {"max_digits": self.max_digits},
                "reversal": {"max_chars": self.max_chars}, "sorting": {"max_chars": self.sort_chars},
                "copy": {"words": self.copy_words, "min_words": min(self.copy_min_words, self.copy_words)},
                "recall": {"min_pairs": self.recall_min_pairs, "style": self.recall_style}}.get(task, {})


class Encoder:
    """Prompt and answer token ids in both formats, with the rows the loss is taken on."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eos = tokenizer.eos_token_id
        marker = "\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                             tokenize=False)
        head, tail = text.split(marker)
        self.chat_head = tokenizer.encode(head, add_special_tokens=False)
        self.chat_tail = tokenizer.encode(tail, add_special_tokens=False)
        end = chat_end_of_turn_ids(tokenizer)
        self.chat_end = list(end) if end else [self.eos]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False))

    def encode(self, insts: list[Instance], chat: list[bool]) -> list[tuple[list[int], int]]:
        """(token ids, answer start) per instance: the answer is ids[start:]."""
        texts = [i.prompt for i in insts] + [i.answer + ("" if c else "\n") for i, c in zip(insts, chat)]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        out = []
        for n, c in enumerate(chat):
            prompt, answer = ids[n], ids[len(insts) + n]
            if c:
                prompt, answer = self.chat_head + prompt + self.chat_tail, answer + self.chat_end
            else:
                answer = answer + [self.eos]
            out.append((prompt + answer, len(prompt)))
        return out


@dataclass
class StepData:
    """One step's sequences in order of length: ``ids`` and ``targets`` [T] (target t is token t+1 where that is
    an answer token, else IGNORE), ``lens`` the sequence lengths, ``loss_weights`` [T] each answer token's part
    of the LM loss (summing to 1; 0 off the answers)."""

    ids: torch.Tensor
    targets: torch.Tensor
    lens: list[int]
    tasks: dict[str, int]
    loss_weights: torch.Tensor

    def pin_memory(self) -> "StepData":
        return StepData(self.ids.pin_memory(), self.targets.pin_memory(), self.lens, self.tasks,
                        self.loss_weights.pin_memory())


def pack(seqs: list[tuple[list[int], int]], groups: list[str] | None = None, parts: dict[str, float] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor]:
    """(ids, targets, lens, loss weights) of ``seqs`` (token ids, answer start) packed in order of length. The
    answer tokens' weights sum to 1: each of ``groups`` (a label per sequence, e.g. its task) a part in proportion
    to its weight in ``parts`` (default 1: equal parts), spread evenly over its answer tokens; without groups,
    every answer token the same."""
    groups = groups or [""] * len(seqs)
    parts = parts or {}
    answers = {}
    for (toks, start), g in zip(seqs, groups):
        answers[g] = answers.get(g, 0) + len(toks) - start
    live = [g for g, n in answers.items() if n]
    total = sum(parts.get(g, 1.0) for g in live)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    ids, targets, lens, weights = [], [], [], []
    for i in order:
        (toks, start), g = seqs[i], groups[i]
        ids += toks
        targets += [IGNORE] * (start - 1) + toks[start:] + [IGNORE]
        part = parts.get(g, 1.0) / (total * answers[g]) if answers[g] else 0.0
        weights += [0.0] * (start - 1) + [part] * (len(toks) - start) + [0.0]
        lens.append(len(toks))
    return (torch.tensor(ids, dtype=torch.int64), torch.tensor(targets, dtype=torch.int64), lens,
            torch.tensor(weights, dtype=torch.float32))


class TaskStream:
    """Steps of training data; step s of a stream with seed ``seed`` is the same on every run."""

    def __init__(self, config: DataConfig, tokenizer, seed: int = 0):
        self.config = config
        self.enc = Encoder(tokenizer)
        self.seed = seed
        self._avg = {t: self._mean_len(t) for t in config.weights}

    def _mean_len(self, task: str) -> float:
        insts = instances(task, 64, "train", seed=-1 - self.seed, **self.config.options(task))
        return sum(len(s) for s, _ in self.enc.encode(insts, [False] * len(insts))) / len(insts)

    def step(self, step: int, progress: float) -> StepData:
        c = self.config
        r = random.Random(f"{self.seed}/{step}")
        seed = self.seed * 1_000_003 + step  # per step instances of the train split, never the eval split
        seqs, tasks, groups = [], {}, []
        recall_tokens = int(c.tokens * c.recall_share)
        hi = c.recall_bound(progress)
        n = 0
        while recall_tokens > c.recall_min:
            length = min(recall_tokens, r.randint(c.recall_min, max(c.recall_min, hi)))
            if length < c.recall_min:
                break
            chat = r.random() < c.chat_share  # a chat reply answers one question: drills in the plain format only
            inst = instances("recall", 1, "train", seed=seed * 64 + n, context_len=length, count=self.enc.count,
                             questions=1 if chat else c.recall_questions, **c.options("recall"))
            seqs += self.enc.encode(inst, [chat])
            groups.append("recall")
            recall_tokens -= len(seqs[-1][0])
            n += 1
        tasks["recall"] = n
        rest = c.tokens - sum(len(s) for s, _ in seqs)
        for task, w in c.weights_at(progress).items():
            k = max(1, int(rest * w / self._avg[task]))
            insts = instances(task, k, "train", seed=seed, **c.options(task))
            chat = [r.random() < c.chat_share for _ in insts]
            if c.question_share > 0 and task in QUESTION_TASKS:
                insts = [as_question(i) if ch and r.random() < c.question_share else i for i, ch in zip(insts, chat)]
            seqs += self.enc.encode(insts, chat)
            groups += [task] * len(insts)
            tasks[task] = k
        ids, targets, lens, weights = pack(seqs, groups if c.loss_balance == "task" else None, c.loss_parts)
        return StepData(ids, targets, lens, tasks, weights)


class StreamDataset(torch.utils.data.IterableDataset):
    """Steps ``first, first + workers, ...`` of a :class:`TaskStream` per worker, so that the workers together
    yield every step in order. ``progress`` is shared memory (``multiprocessing.Value``) the trainer keeps at
    its fraction of training done: the recall curriculum of a step follows it."""

    def __init__(self, config: DataConfig, tokenizer, seed: int, progress, first: int = 0):
        self.config, self.tokenizer, self.seed, self.progress, self.first = config, tokenizer, seed, progress, first

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = TaskStream(self.config, self.tokenizer, self.seed)
        s = self.first + wid
        while True:
            yield stream.step(s, self.progress.value)
            s += nw
