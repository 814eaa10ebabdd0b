"""The training forward: the inference model itself (the layers the engine runs), over a
:class:`~dayzero.train.batch.TrainBatch`, with the ops of the ``train`` platform and functional caches.

:func:`training` is the mode (``use_platform("train")`` + :func:`~dayzero.train.batch.train_caches`);
:func:`losses` runs one forward in it and returns the step's losses:

- ``lm``: next-token cross-entropy over the answer rows (targets other than ``IGNORE``), mean per token, or
  weighted by ``loss_weights`` [T] (summing to 1 over the answer rows: the data's per-task balance);
- ``balance``: the MoE routers' sequence-wise balance loss (:func:`~dayzero.train.routing.balance_loss`);
- ``indexer_kl``: the DSA indexers' KL to the main attention (:mod:`dayzero.train.attention`), summed over the
  DSA layers; zero when no sequence is longer than the indexers' top-k.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dayzero.ops.registry import use_platform
from dayzero.train import attention as _attention  # noqa: F401 - registers the train platform's ops
from dayzero.train import fused as _fused  # noqa: F401
from dayzero.train import linear_attention as _linear  # noqa: F401
from dayzero.train import routing
from dayzero.train.batch import TrainBatch, clear_caches, take, to_device, train_caches
from dayzero.train.data import IGNORE

TRAIN = "train"


@contextlib.contextmanager
def training(model):
    """The training mode for the block: the ``train`` platform's ops, functional caches on every cached layer."""
    with use_platform(TRAIN), train_caches(model):
        try:
            yield
        finally:
            clear_caches(model)


def logits_of(model, hidden: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, vocab] fp32 through the (possibly tied) LM head, differentiable."""
    return F.linear(hidden, model.lm_head.weight).float()


@dataclass
class StepLosses:
    lm: torch.Tensor
    balance: torch.Tensor
    indexer_kl: torch.Tensor
    routes: list
    answer_tokens: int


def answer_rows(targets: torch.Tensor) -> torch.Tensor:
    """[T] targets -> the rows whose target is an answer token (call it on the host's copy: on the device it
    reads its output size back)."""
    return (targets != IGNORE).nonzero()[:, 0]


def losses(model, batch: TrainBatch, targets: torch.Tensor, loss_weights: torch.Tensor | None = None,
           rows: torch.Tensor | None = None) -> StepLosses:
    """One forward of ``model`` (already in :func:`training` mode) over ``batch``; ``targets`` [T]; ``rows``:
    :func:`answer_rows` of them, when the caller has it."""
    with routing.recording() as routes:
        hidden = model(batch)  # [T, D]
    rows = answer_rows(targets) if rows is None else to_device(rows, hidden.device)
    if not rows.numel():
        lm = hidden.sum() * 0
    elif loss_weights is None:
        lm = F.cross_entropy(logits_of(model, take(hidden, rows)), targets[rows])
    else:
        ce = F.cross_entropy(logits_of(model, take(hidden, rows)), targets[rows], reduction="none")
        lm = (ce * loss_weights[rows]).sum()
    balance = routing.balance_loss(routes, batch.seq_of_row, batch.num_seqs)
    kls = batch.losses.get("indexer_kl", [])
    kl = torch.stack(kls).sum() if kls else torch.zeros((), device=hidden.device)
    return StepLosses(lm, balance, kl, routes, int(rows.numel()))


def moe_layers(model) -> list:
    from dayzero.layers.moe import MoE

    return [m for m in model.modules() if isinstance(m, MoE)]


def indexer_parameters(model) -> list[torch.nn.Parameter]:
    """The DSA indexers' parameters: trained by their KL loss only."""
    from dayzero.layers.attention.dsa import Indexer

    return [p for m in model.modules() if isinstance(m, Indexer) for p in m.parameters()]
