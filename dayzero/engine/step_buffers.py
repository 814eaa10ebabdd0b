"""Persistent device tensors that every step's batch is written into.

A step's index tensors (token ids, positions, slot mapping, state slots, block tables, ...) are built on the
host from the schedule, staged in page-locked memory and copied to the device into buffers allocated once: no
pageable transfer (which would wait for the device), no allocation per step, and the same addresses every step,
which is what a captured CUDA graph reads. On a CPU device the "device" buffers are the staging buffers
themselves.

The device buffers are views of one int64 arena (``fresh``'s flags are bytes of its words), so a step's fields go
over in two operations, not one copy each: the values and their places in the arena packed into one staging
buffer, one copy of it, and one scatter into the arena (the ``step_inputs`` op, which also patches an overlapped
step's input ids with the previous step's samples: one Triton launch on a GPU). Ten copies of a few bytes each
took 27 µs of a batch-1 decode step on the H100, ~2.7 µs apiece. A step with more than :data:`PACKED_MAX` values
(long prefill steps, wide block tables) copies field by field, as the staging buffer is sized for decode steps.

The block tables of a step are laid out densely at the start of their buffer, ``[B, W]`` for B sequences and
W columns, so a graph captured for (B, W) reads exactly what a step of that shape writes. With ``groups`` = 2
(sliding-window layers with a pool of their own) their slot mapping and block tables have buffers of their own
(``slot_mapping1``, ``block_tables1``).
"""
from __future__ import annotations

import numpy as np
import torch

from dayzero.ops import call

PACKED_MAX = 1 << 14  # values a step may send through the packed copy


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int, topk: int = 0,
                 groups: int = 1, staged: bool | None = None):
        """``staged``: copy through page-locked host buffers (the default on a CUDA device; a CPU test may ask for
        it, the arena then being CPU memory of its own)."""
        self.device = device
        self.staged = device.type == "cuda" if staged is None else staged
        self.sizes = {"input_ids": max_tokens, "positions": max_tokens, "rope_positions": max_tokens, "slot_mapping": max_tokens,
                      "state_slots": max_seqs, "logits_indices": max_seqs, "cu_seqlens": max_seqs + 1,
                      "block_tables": max_seqs * max_blocks,
                      # an overlapped step's rows that take the previous step's samples, and those samples' rows
                      "patch_rows": max_seqs, "patch_src": max_seqs}
        if groups > 1:
            self.sizes.update(slot_mapping1=max_tokens, block_tables1=max_seqs * max_blocks)
        self.sizes["fresh"] = -(-max_seqs // 8)  # int64 words holding one bool byte per sequence
        self.max_tokens, self.max_seqs, self.max_blocks, self.groups = max_tokens, max_seqs, max_blocks, groups
        self.offsets = dict(zip(self.sizes, np.cumsum([0, *self.sizes.values()])[:-1].tolist()))
        self.arena = torch.zeros(sum(self.sizes.values()), dtype=torch.int64, device=device)
        self.dev = {n: self.arena[o:o + self.sizes[n]] for n, o in self.offsets.items()}
        self.dev["fresh"] = self.dev["fresh"].view(torch.bool)[:max_seqs]
        pin = self.staged and device.type == "cuda"
        if self.staged:
            self.host = {n: torch.zeros(s, dtype=torch.int64, pin_memory=pin) for n, s in self.sizes.items()}
            self.host["fresh"] = self.host["fresh"].view(torch.bool)
            self._stage = torch.zeros(2 * PACKED_MAX, dtype=torch.int64, pin_memory=pin)  # values, then places
            self._dev_stage = torch.zeros(2 * PACKED_MAX, dtype=torch.int64, device=device)
        else:
            self.host = self.dev
        self._np = {n: t.numpy() for n, t in self.host.items()}
        self._puts: dict[str, int] = {}  # field -> elements staged since begin()
        # [T, topk] DSA selection, written on the device only
        self.topk = torch.full((max_tokens, max(topk, 1)), -1, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def _patch(self, patch: tuple | None) -> None:
        """:meth:`end`'s patch alone, where no packed scatter carries it."""
        if patch is not None:
            call("step_inputs", self.arena, self.arena[:0], 0, patch)

    def fits(self, tokens: int, seqs: int, blocks: int) -> bool:
        return tokens <= self.max_tokens and seqs <= self.max_seqs and blocks <= self.max_blocks

    def begin(self) -> None:
        """Wait until the previous step's copies have left the staging buffers (normally long done)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self._puts.clear()

    def put(self, name: str, values) -> torch.Tensor:
        """Stage ``values`` (a list or array of ints) and return the device view that holds them after :meth:`end`."""
        n = len(values)
        self._np[name][:n] = values
        return self._staged(name, n)

    def put_table(self, tables: list[list[int]], rows: int, width: int, name: str = "block_tables") -> torch.Tensor:
        """Block tables of ``rows`` sequences as a dense [rows, width] view, 0 (the null block) past each table."""
        view = self._np[name][: rows * width].reshape(rows, width)
        view[:] = 0
        for i, t in enumerate(tables):
            view[i, : len(t)] = t
        return self._staged(name, rows * width).view(rows, width)

    def _staged(self, name: str, n: int) -> torch.Tensor:
        if self.staged and n:
            self._puts[name] = max(n, self._puts.get(name, 0))
        return self.dev[name][:n]

    def _words(self, name: str, n: int) -> tuple[np.ndarray, int]:
        """The staged int64 words of a field's first n elements, and how many there are."""
        if name == "fresh":
            k = -(-n // 8)
            return self._np["fresh"][:8 * k].view(np.int64), k
        return self._np[name][:n], n

    def end(self, patch: tuple | None = None) -> None:
        """Send the values staged since :meth:`begin` to the device, and mark the staging buffers in use until
        those copies have run. ``patch`` = (ids, rows, src, tokens): then ``ids[rows[i]] = tokens[src[i]]`` (at
        least 0) on the device, rows and src being staged views (``step_inputs``: one launch with the scatter)."""
        if not self.staged:
            self._patch(patch)
            return
        words = [(name, *self._words(name, n)) for name, n in self._puts.items()]
        total = sum(k for _, _, k in words)
        if 0 < total <= PACKED_MAX:
            stage, at = self._stage.numpy(), 0  # [values | their places in the arena]
            for name, values, k in words:
                stage[at:at + k] = values
                stage[total + at:total + at + k] = np.arange(self.offsets[name], self.offsets[name] + k)
                at += k
            dev = self._dev_stage[:2 * total]
            dev.copy_(self._stage[:2 * total], non_blocking=True)
            call("step_inputs", self.arena, dev, total, patch)
        else:
            for name, n in self._puts.items():
                self.dev[name][:n].copy_(self.host[name][:n], non_blocking=True)
            self._patch(patch)
        self._puts.clear()
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
