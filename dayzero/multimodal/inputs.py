"""The images of one request as the engine keeps them, and what one step hands the model.

A request's prompt holds one placeholder token per image; :func:`expand_placeholders` widens each to the
image's ``num_tokens`` copies, and image k then owns prompt positions ``start_k .. start_k + num_tokens_k - 1``.
Each image is named by a content hash (:func:`image_key`), which the encoder cache and the prefix cache key by:
two requests with the same picture share its features and, with the same text before it, its cache blocks.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ImageItem:
    key: bytes  # BLAKE2b-128 of the pixel rows and the grid
    pixel_values: torch.Tensor  # [N, ...] fp32 host rows, as the processor made them
    grid: tuple[int, int, int]  # patches along (t, h, w)
    start: int  # first placeholder position in the expanded prompt
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SeqImages:
    """A request's images (shared by its ``n`` sequences) and, for multimodal RoPE, its prompt's positions."""

    items: tuple[ImageItem, ...]
    rope: torch.Tensor | None = None  # [3, L] int64 (t, h, w) positions of the prompt; None: 1-D positions
    rope_delta: int = 0  # a token at index i >= L has position i + rope_delta on all three axes

    def overlapping(self, a: int, b: int):
        """(image, first, last) for every image whose tokens meet positions a..b-1: its tokens first..last-1
        (counted from the image's own start) fall in the range."""
        for it in self.items:
            lo, hi = max(a, it.start), min(b, it.end)
            if lo < hi:
                yield it, lo - it.start, hi - it.start

    def block_key(self, start: int, end: int) -> bytes:
        """The prefix-cache extra key of the block of positions start..end-1: hash and offset of each image
        whose tokens it holds (b"" for a block of text only)."""
        return b"".join(it.key + first.to_bytes(4, "little") for it, first, _ in self.overlapping(start, end))

    def rope_positions(self, a: int, b: int) -> torch.Tensor:
        """[3, b-a] int64 positions of tokens a..b-1 (prompt positions, then text after the prompt)."""
        L = self.rope.shape[1]
        head = self.rope[:, a:min(b, L)]
        if b <= L:
            return head
        tail = torch.arange(max(a, L), b, dtype=torch.int64) + self.rope_delta
        return torch.cat((head, tail.expand(3, -1)), dim=1)


@dataclass
class StepImages:
    """What a forward pass takes from the images of its step."""

    rows: torch.Tensor  # [R] int64 batch rows that are image placeholders
    embeds: torch.Tensor  # [R, D] features replacing those rows' embeddings
    deepstack: list[torch.Tensor]  # each [R, D], added after decoder layer i (Qwen3-VL)


def image_key(pixel_values: torch.Tensor, grid: tuple[int, int, int]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(grid, dtype=np.int64).tobytes())
    h.update(pixel_values.detach().cpu().contiguous().numpy().tobytes())
    return h.digest()


def expand_placeholders(ids: list[int], image_token_id: int, num_tokens: list[int]) -> tuple[list[int], list[int]]:
    """Each placeholder of ``ids`` (exactly ``len(num_tokens)`` of them, checked by the caller) repeated to its
    image's token count: (expanded ids, each image's first position)."""
    out, starts, k = [], [], 0
    for t in ids:
        if t == image_token_id:
            starts.append(len(out))
            out += [t] * num_tokens[k]
            k += 1
        else:
            out.append(t)
    return out, starts
