"""Persistent device tensors that every step's batch is written into.

A step's index tensors (token ids, positions, slot mapping, state slots, block tables, ...) are built on the
host from the schedule, staged in page-locked memory and copied to the device with non-blocking copies into
buffers allocated once: no pageable transfer (which would wait for the device), no allocation per step, and
the same addresses every step, which is what a captured CUDA graph reads. On a CPU device the "device" buffers
are the staging buffers themselves.

The block tables of a step are laid out densely at the start of their buffer, ``[B, W]`` for B sequences and
W columns, so a graph captured for (B, W) reads exactly what a step of that shape writes. With ``groups`` = 2
(sliding-window layers with a pool of their own) their slot mapping and block tables have buffers of their own
(``slot_mapping1``, ``block_tables1``).
"""
from __future__ import annotations

import torch


class StepBuffers:
    def __init__(self, device: torch.device, max_tokens: int, max_seqs: int, max_blocks: int, topk: int = 0,
                 groups: int = 1):
        self.device = device
        self.pinned = device.type == "cuda"
        self.sizes = {"input_ids": max_tokens, "positions": max_tokens, "rope_positions": max_tokens, "slot_mapping": max_tokens,
                      "state_slots": max_seqs, "logits_indices": max_seqs, "cu_seqlens": max_seqs + 1,
                      "block_tables": max_seqs * max_blocks}
        if groups > 1:
            self.sizes.update(slot_mapping1=max_tokens, block_tables1=max_seqs * max_blocks)
        self.max_tokens, self.max_seqs, self.max_blocks, self.groups = max_tokens, max_seqs, max_blocks, groups
        self.host = {n: torch.zeros(size, dtype=torch.int64, pin_memory=self.pinned) for n, size in self.sizes.items()}
        self.host["fresh"] = torch.zeros(max_seqs, dtype=torch.bool, pin_memory=self.pinned)
        if self.pinned:
            self.dev = {n: torch.zeros_like(t, device=device) for n, t in self.host.items()}
        else:
            self.dev = self.host
        self._np = {n: t.numpy() for n, t in self.host.items()}
        # [T, topk] DSA selection, written on the device only
        self.topk = torch.full((max_tokens, max(topk, 1)), -1, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None

    def fits(self, tokens: int, seqs: int, blocks: int) -> bool:
        return tokens <= self.max_tokens and seqs <= self.max_seqs and blocks <= self.max_blocks

    def begin(self) -> None:
        """Wait until the previous step's copies have left the staging buffers (normally long done)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def put(self, name: str, values) -> torch.Tensor:
        """Stage ``values`` (a list or array of ints) and return the device view holding them."""
        n = len(values)
        self._np[name][:n] = values
        return self._copy(name, n)

    def put_table(self, tables: list[list[int]], rows: int, width: int, name: str = "block_tables") -> torch.Tensor:
        """Block tables of ``rows`` sequences as a dense [rows, width] view, 0 (the null block) past each table."""
        view = self._np[name][: rows * width].reshape(rows, width)
        view[:] = 0
        for i, t in enumerate(tables):
            view[i, : len(t)] = t
        return self._copy(name, rows * width).view(rows, width)

    def _copy(self, name: str, n: int) -> torch.Tensor:
        dev = self.dev[name][:n]
        if self.pinned:
            dev.copy_(self.host[name][:n], non_blocking=True)
        return dev

    def end(self) -> None:
        """Mark the staging buffers in use until the copies queued since :meth:`begin` have run."""
        if self.pinned:
            self._copied = torch.cuda.Event()
            self._copied.record()
