"""Text for responses: the text offsets and the bytes and display strings of tokens for logprobs, and the
engine's per-step deltas put together into stream events and whole choices.

The engine reports each output in delta form: the tokens of the step, and the text that can no longer
change (a character still arriving, or a tail that may be the start of a stop string, waits), so the
reported texts add up to the final text and a stream may send each as it comes.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Callable

from dayzero.engine.request import REPLACEMENT, CompletionOutput, RequestOutput

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # sentencepiece byte fallback


def _byte_level_table() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 style): the printable stand-in character of each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """The bytes and display string of one token, as OpenAI logprobs show them.

    A token that is not valid UTF-8 on its own (one byte of a multi-byte character) is shown as
    ``bytes:\\xe4\\xbd`` with its raw bytes in ``bytes``.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = _byte_level_table() if type(decoder).__name__ == "ByteLevel" else None

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if tok is None:
            return f"token_id:{token_id}", []
        piece = tok.convert_ids_to_tokens(token_id)
        if token_id in self._special or piece is None:
            raw = (piece or "").encode()
        elif self._byte_level is not None and all(c in self._byte_level for c in piece):
            raw = bytes(self._byte_level[c] for c in piece)
        elif (m := _BYTE_TOKEN.match(piece)) is not None:
            raw = bytes([int(m.group(1), 16)])
        else:
            raw = tok.decode([token_id]).encode()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


class TextOffsets:
    """``text_offset`` of completions logprobs for one output: for each token, how many characters of the
    returned text the tokens before it produce. A token inside a character (one byte of a multi-byte
    character) gets that character's offset; tokens past the end of the text (after a stop string) get
    its length.

    Fed the tokens in order with the text as it grows (a stream: what has been sent, which never changes;
    otherwise the whole text at once). Each token decodes a short window of the tokens not yet matched to
    the text, after the last matched ones as left context, as ``IncrementalText`` does, so a long output
    costs one short decode per token.
    """

    MAX_WINDOW = 8  # unmatched tokens (bytes of broken characters) after which their offsets are taken as found

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.ids: list[int] = []  # ids[:context] are the left context; ids[context:] the window
        self.context = 0
        self.context_len = 0  # len(decode(ids[:context]))
        self.chars = 0  # characters of the text that the tokens before the window produce
        self.tail = ""  # the text as far as it is known, from character ``self.chars - self.at`` on
        self.at = 0  # where ``self.chars`` falls in ``tail``

    def __call__(self, token_ids: list[int], text: str) -> list[int]:
        """Offsets of ``token_ids``; ``text``: what the text grew by since the last call."""
        if self.at > 4096:  # drop what no window can reach again
            self.tail, self.at = self.tail[self.at:], 0
        self.tail += text
        out = []
        for t in token_ids:
            window = self.decode(self.ids)[self.context_len:] if len(self.ids) > self.context else ""
            k = len(os.path.commonprefix([window, self.tail[self.at:self.at + len(window)]]))
            out.append(self.chars + k)
            whole = k == len(window) and not window.endswith(REPLACEMENT)
            if whole or len(self.ids) - self.context >= self.MAX_WINDOW:
                self.chars += k
                self.at += k
                self.ids = self.ids[self.context:]  # the window becomes the next one's left context
                self.context = len(self.ids)
                self.context_len = len(self.decode(self.ids)) if self.ids else 0
            self.ids.append(t)
        return out


@dataclass
class Delta:
    choice: int  # prompt index * n + output index
    text: str
    token_ids: list[int]  # tokens since the last delta of this choice
    logprobs: list[float] | None
    finish_reason: str | None  # set on the choice's last delta
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def add(self, o: CompletionOutput) -> None:
        self.text += o.text
        _extend(self, o)


def _extend(into, o: CompletionOutput) -> None:
    into.token_ids.extend(o.token_ids)
    if o.logprobs is not None:
        into.logprobs = into.logprobs or []
        into.logprobs.extend(o.logprobs)
    if o.top_logprobs is not None:
        into.top_logprobs = into.top_logprobs or []
        into.top_logprobs.extend(o.top_logprobs)
    if o.finish_reason is not None:
        into.finish_reason = o.finish_reason


class ChoiceDeltas:
    """The stream events of a request's choices from the engine's deltas: each batch of deltas becomes at
    most one event per choice, and tokens that bring no text yet (a character still arriving) wait to go
    out with the text they make, or with the finish reason."""

    def __init__(self, n: int):
        self.n = n
        self._pending: dict[int, Delta] = {}

    def __call__(self, items: list[tuple[int, RequestOutput]]) -> list[Delta]:
        touched: dict[int, None] = {}
        for tag, out in items:
            for o in out.outputs:
                choice = tag * self.n + o.index
                d = self._pending.get(choice)
                if d is None:
                    d = self._pending[choice] = Delta(choice, "", [], None, None)
                d.add(o)
                touched[choice] = None
        ready = [self._pending.pop(c) for c in touched
                 if self._pending[c].text or self._pending[c].finish_reason is not None]
        return ready


@dataclass
class Choice:
    """One whole output of a non-streamed request, put together from its deltas."""

    parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add(self, o: CompletionOutput) -> None:
        self.parts.append(o.text)
        _extend(self, o)
