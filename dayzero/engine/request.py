"""Requests and the sequences they expand to (``n`` sequences per request)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from dayzero.engine.detokenizer import IncrementalText
from dayzero.engine.sampling_params import SamplingParams

_seq_ids = itertools.count()


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
    max_tokens: int = 0  # resolved: params.max_tokens, or the rest of the context
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass
class CompletionOutput:
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
