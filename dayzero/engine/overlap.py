"""What overlapping a step with the next one (``EngineConfig.async_scheduling``) needs to carry between them.

A step's sampled token ids stay on the device: the next step is scheduled on the host as if they were known
(each sampled sequence holds a pending token, ``Sequence.add_pending``), its rows whose input is a pending
token are patched on the device from the previous step's samples (:func:`pending_inputs`), and it is queued
before the host waits for those samples. The host's work of a step (appending tokens, stop checks, text,
outputs, prefix-cache commits) then runs while the device computes the next one.

What the host must know before it can queue the next step keeps the two in order: a step that samples with
repetition, presence or frequency penalties reads every generated id (:func:`needs_resolved_ids`), so the
previous samples are read first (after the forward pass is queued, before sampling).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dayzero.engine.request import Sequence
from dayzero.engine.sampler import PendingSample


@dataclass
class InFlight:
    """A queued step whose samples the host has not read yet."""

    seqs: list[Sequence]  # the sampled sequences, in the order of the sampler's rows
    tokens: torch.Tensor  # [S] int64 on the device: their sampled ids (-1: non-finite logits)
    host: PendingSample  # the same rows on their way to the host


def pending_inputs(scheduled, prev: InFlight) -> tuple[list[int], list[int], torch.Tensor]:
    """(batch rows, rows of ``prev.tokens``, ``prev.tokens``): the inputs of this step that are the previous
    step's samples. Only one step is ever in flight, so a sequence holds at most one pending token here, and
    it is the input of its decode row."""
    where = {id(q): j for j, q in enumerate(prev.seqs)}
    rows, src, row = [], [], 0
    for s in scheduled:
        q = s.seq
        if q.num_pending and id(q) in where and q.num_computed <= q.num_resolved < q.num_computed + s.num_tokens:
            rows.append(row + q.num_resolved - q.num_computed)
            src.append(where[id(q)])
        row += s.num_tokens
    return rows, src, prev.tokens


def needs_resolved_ids(seqs: list[Sequence]) -> bool:
    """Whether sampling these sequences reads the ids of the tokens they generated (penalties)."""
    return any(q.params.penalised for q in seqs)
