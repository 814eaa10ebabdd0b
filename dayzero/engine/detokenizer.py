"""The text of a growing output, decoded a few tokens at a time instead of whole at every step.

Decoding the whole output at every step costs O(n) per token, O(n²) per output: at 4K output tokens and 64
running sequences that is hundreds of thousands of tokens decoded per step. Here each step decodes two
short windows of ids: ``ids[prefix:read]`` (tokens already turned into text, kept as left context so that
tokenizers that treat the first token of a decode specially, e.g. SentencePiece's leading space, give the
same text as a whole decode) and ``ids[prefix:]``; the text the new tokens add is the difference.

A new tail that ends in U+FFFD is a character still arriving (a byte-level or byte-fallback token holds
part of it): it waits for the next token. Past ``MAX_PENDING`` waiting tokens no character can still
complete (UTF-8 has at most 4 bytes), so the tail is taken as it is and the window stays short even for
outputs that are not valid UTF-8. ``text`` only ever grows; the engine replaces it with one whole decode
when the output finishes, so the final text is exactly the tokenizer's.
"""
from __future__ import annotations

from typing import Callable

REPLACEMENT = "\ufffd"
MAX_PENDING = 6  # tokens a character may take to complete before its tail is taken as is


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self.prefix = 0  # ids[prefix:read] are the left context of the next decode
        self.read = 0  # ids[:read] are in ``text``

    def update(self, ids: list[int], start: int = 0, end: int | None = None) -> str:
        """Extend ``text`` with what the tokens since the last call add; the output is ``ids[start:end]`` (a
        sequence's whole token list, its prompt length and the tokens the host has, so no step copies the whole
        output). Returns the text added."""
        end = len(ids) if end is None else end
        n = end - start  # output tokens so far
        window = ids[start + self.prefix:end]
        new = self.decode(window)
        if new.endswith(REPLACEMENT) and n - self.read < MAX_PENDING:
            return ""
        old = self.decode(window[: self.read - self.prefix])
        added = new[len(old):]  # the context decodes to a prefix of the longer window for the tokenizers in use
        self.text += added
        self.prefix, self.read = self.read, n
        return added
