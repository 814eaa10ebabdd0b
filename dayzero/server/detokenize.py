"""Text for streaming: deltas that never split a character or leak the start of a stop string, and the
text and bytes of single tokens for logprobs.

The engine reports each output's whole text so far. A byte-level tokenizer emits one UTF-8 byte per
token, so that text may end in an incomplete character, which decodes to U+FFFD; later bytes complete it
and the tail changes. Everything before such a tail never changes again (UTF-8 is self-synchronising),
so a stream may send the text up to it and hold the tail back until the next token or the end.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dayzero.engine.request import RequestOutput

REPLACEMENT = "\ufffd"


class TextStreamer:
    """Turns the successive cumulative texts of one output into deltas that are safe to send.

    Held back while the output runs: a trailing U+FFFD (a character still being completed) and the
    longest tail that could be the start of a stop string (the engine cuts the final text at the stop
    string, so that tail may vanish). When the output finishes the engine's final text is authoritative
    and the rest of it is sent.
    """

    def __init__(self, stop: list[str] | None = None):
        self.stop = [s for s in (stop or []) if s]
        self.sent = 0  # characters of the text already sent

    def delta(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1
            end -= self._stop_prefix(text, end)
        if end <= self.sent:
            return ""
        out = text[self.sent:end]
        self.sent = end
        return out

    def _stop_prefix(self, text: str, end: int) -> int:
        """Length of the longest unsent tail of ``text[:end]`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, end - self.sent), best, -1):
                if text.endswith(s[:k], 0, end):
                    best = k
                    break
        return best


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


@dataclass
class Delta:
    choice: int  # prompt index * n + output index
    text: str
    token_ids: list[int]  # tokens since the last delta of this choice
    logprobs: list[float] | None
    finish_reason: str | None  # set on the choice's last delta
    top_logprobs: list[list[tuple[int, float]]] | None = None


class ChoiceDeltas:
    """What is new in each choice of a streamed request since the last call: text (held back as
    :class:`TextStreamer` says), the tokens behind it, and the finish reason, which comes once."""

    def __init__(self, n: int, stop: list[str]):
        self.n, self.stop = n, stop
        self._text: dict[int, TextStreamer] = {}
        self._tokens: dict[int, int] = {}  # tokens sent per choice
        self._finished: set[int] = set()

    def __call__(self, changed: dict[int, RequestOutput]) -> list[Delta]:
        deltas = []
        for tag, out in changed.items():
            for o in out.outputs:
                choice = tag * self.n + o.index
                if choice in self._finished:
                    continue
                done = o.finish_reason is not None
                text = self._text.setdefault(choice, TextStreamer(self.stop)).delta(o.text, done)
                if not text and not done:
                    continue  # tokens whose text is held back go out with the next delta
                k = self._tokens.get(choice, 0)
                self._tokens[choice] = len(o.token_ids)
                lps = o.logprobs[k:] if o.logprobs is not None else None
                tops = o.top_logprobs[k:] if o.top_logprobs is not None else None
                deltas.append(Delta(choice, text, o.token_ids[k:], lps, o.finish_reason if done else None, tops))
                if done:
                    self._finished.add(choice)
        return deltas
