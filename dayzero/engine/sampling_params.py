"""Per-request sampling settings, checked once when the request is made.

:class:`SamplingParams` is the user-facing knob set (vLLM/OpenAI names). Every field is
validated in ``__post_init__``; a bad value raises ``ValueError`` whose message starts with the
field name, states the allowed range and shows the value given (``"top_p must be in (0, 1],
got 0"``), so the server can pass the message to the client as a 400 with ``param`` set.
Values are normalised on the way in: ``stop`` and ``stop_token_ids`` become lists, numeric
fields become plain ``int``/``float`` (numpy scalars are accepted).

``max_tokens=None`` means "the rest of the context"; the engine resolves it once it knows the
prompt length.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass


def _is_int(x) -> bool:
    # bool is an Integral subclass, but True as a token count is always a mistake
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fail(name: str, allowed: str, value) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely alternatives
    logprobs: int | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        self.n = self._int("n", self.n, lo=1)
        if self.max_tokens is not None:
            self.max_tokens = self._int("max_tokens", self.max_tokens, lo=1, or_none=True)
        self._check_min_tokens()

        self.temperature = self._real("temperature", self.temperature, ">= 0 and finite",
                                      lambda t: math.isfinite(t) and t >= 0)
        self.top_p = self._real("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        if not _is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            raise _fail("top_k", "-1 (disabled) or an int >= 1", self.top_k)
        self.top_k = int(self.top_k)
        self.min_p = self._real("min_p", self.min_p, "in [0, 1]", lambda p: 0 <= p <= 1)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, self._real(name, getattr(self, name), "in [-2, 2]",
                                           lambda v: -2 <= v <= 2))
        self.repetition_penalty = self._real("repetition_penalty", self.repetition_penalty,
                                             "> 0 and finite", lambda r: math.isfinite(r) and r > 0)

        if self.seed is not None:
            self.seed = self._int("seed", self.seed, or_none=True)
        self._check_stop()
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(name, "a bool", getattr(self, name))
        if self.logprobs is not None:
            self.logprobs = self._int("logprobs", self.logprobs, lo=0, or_none=True)

    @property
    def penalised(self) -> bool:
        """True when repetition, presence or frequency penalties read the ids generated so far."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0, or only the top token allowed."""
        return self.temperature == 0 or self.top_k == 1

    # -- validation helpers ------------------------------------------------------------------

    @staticmethod
    def _int(name: str, value, lo: int | None = None, or_none: bool = False) -> int:
        allowed = "an int" if lo is None else f"an int >= {lo}"
        if or_none:
            allowed += " or None"
        if not _is_int(value) or (lo is not None and value < lo):
            raise _fail(name, allowed, value)
        return int(value)

    @staticmethod
    def _real(name: str, value, allowed: str, ok) -> float:
        if not _is_real(value):
            raise _fail(name, f"a number {allowed}", value)
        # NaN fails every comparison, so range checks written as `lo <= v <= hi` reject it
        if not ok(float(value)):
            raise _fail(name, allowed, value)
        return float(value)

    def _check_min_tokens(self) -> None:
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _fail("min_tokens", "an int >= 0", self.min_tokens)
        self.min_tokens = int(self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")

    def _check_stop(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)):
            stop = list(stop)
        else:
            raise _fail("stop", "a string, a list of strings or None", stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop entries must be non-empty strings, got {s!r}")
        self.stop = stop

        ids = self.stop_token_ids
        if ids is None:
            ids = []
        elif isinstance(ids, (list, tuple)):
            ids = list(ids)
        else:
            raise _fail("stop_token_ids", "a list of ints >= 0 or None", ids)
        for t in ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids entries must be ints >= 0, got {t!r}")
        self.stop_token_ids = [int(t) for t in ids]
