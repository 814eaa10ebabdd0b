"""Requests and the sequences they expand to (``n`` sequences per request), the seed of each sample, and how
much of a running output's text is final enough to report."""
from __future__ import annotations

import enum
import hashlib
import itertools
import time
from dataclasses import dataclass, field

import torch

from dayzero.engine.detokenizer import IncrementalText
from dayzero.engine.sampling_params import SamplingParams
from dayzero.multimodal.inputs import SeqImages

_seq_ids = itertools.count()
PENDING_ID = -1  # a sampled token still on its way to the host (never an input: the runner patches it on the device)
REPLACEMENT = "\ufffd"


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of output ``index`` of a request seeded with ``seed``: a hash of both, so that the n
    outputs of one request are independent of each other and of every other seed's (``seed + index`` would
    make output 1 of seed 42 the same draw as output 0 of seed 43)."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{index}".encode(), digest_size=8).digest(), "little")


def reportable_end(text: str, start: int, stops: list[str]) -> int:
    """How far a running output's ``text`` can be reported, ``text[:start]`` having been already: all of it
    but a trailing U+FFFD (bytes of a character still arriving: only the last one can still change, as UTF-8
    resynchronises at the next lead byte) and the longest tail that could be the start of a stop string (the
    final text is cut where a stop string starts, so that tail may vanish)."""
    end = len(text)
    if end > start and text[end - 1] == REPLACEMENT:
        end -= 1
    best = 0  # the longest unreported tail text[end - best:end] that is a proper prefix of a stop string
    for s in stops:
        p = text.find(s[0], max(start, end - len(s) + 1), end)
        while p != -1 and end - p > best:
            if s.startswith(text[p:end]):
                best = end - p
                break
            p = text.find(s[0], p + 1, end)
    return end - best


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generated continuation. ``num_computed`` tokens are in the cache; the engine catches it up with
    ``len(token_ids)`` a chunk at a time, and samples a new token only once it has caught up."""

    request_id: str
    index: int  # which of the request's n outputs
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    max_tokens: int = 0  # resolved: params.max_tokens, or what fits in the rest of the context and the cache
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # params.logprobs alternatives per token
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    detok: IncrementalText | None = None  # the running text, until the finished output's whole decode
    arrival: float = field(default_factory=time.monotonic)
    num_preemptions: int = 0
    delta: bool = False  # outputs in delta form (see LLMEngine.add_request)
    reported_tokens: int = 0  # delta form: the output tokens, characters of text and finish reported so far
    reported_chars: int = 0
    reported_finish: bool = False
    # Overlapped steps (``async_scheduling``): the last ``num_pending`` entries of ``token_ids`` are tokens sampled
    # on the device whose ids have not reached the host yet (PENDING_ID in the list); ``hold``: the sequence ends
    # with them whatever they are (its length limit), so it is not scheduled again.
    num_pending: int = 0
    hold: bool = False
    images: SeqImages | None = None  # the prompt's images (shared by a request's sequences)

    @property
    def block_keys(self):
        """What the prefix cache hashes into a block beyond its token ids (the images it holds), or None."""
        return self.images.block_key if self.images is not None else None

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence, pending ones included (what the scheduler catches the cache up with)."""
        return len(self.token_ids)

    @property
    def num_resolved(self) -> int:
        """Tokens whose ids the host has."""
        return len(self.token_ids) - self.num_pending

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:self.num_resolved]

    @property
    def num_output(self) -> int:
        return self.num_resolved - self.num_prompt_tokens

    def add_pending(self, max_model_len: int) -> None:
        """A token was sampled for this sequence on the device: hold its place until its id arrives."""
        self.token_ids.append(PENDING_ID)
        self.num_pending += 1
        self.hold = self.num_output + self.num_pending >= self.max_tokens or self.num_tokens >= max_model_len

    def resolve(self, tok: int) -> None:
        """The oldest pending token's id has arrived (or, with nothing pending, a token is appended)."""
        if self.num_pending:
            self.token_ids[self.num_resolved] = tok
            self.num_pending -= 1
        else:
            self.token_ids.append(tok)

    def drop_pending(self) -> None:
        """The sequence ends: tokens still in flight are not part of it."""
        if self.num_pending:
            del self.token_ids[self.num_resolved:]
            self.num_pending = 0
        self.hold = False

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class CompletionOutput:
    """One output of a request: everything so far, or, in delta form, what is new since its last report
    (token ids, logprobs and text; the reports' texts add up to the final text)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None = None
    stop_reason: str | int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob) of the most likely, best first


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
