"""MoE training: what the routers chose, their balance, and the routed experts (the ``train`` platform).

Balance (DeepSeek-V3, sigmoid routers with ``e_score_correction_bias``), both used:

- auxiliary-loss-free: after every step each expert's selection bias moves by ``rate`` towards the mean load,
  ``b_i += rate · sign(mean load − load_i)`` (:func:`update_bias`); the bias steers only selection, so it
  takes no gradient;
- a small sequence-wise balance loss (:func:`balance_loss`), ``α Σ_i f_i P_i`` per sequence, averaged:
  ``f_i = E / (k T_s) · #{t in s: i chosen}`` and ``P_i`` the mean over the sequence of the router's
  normalised scores ``s_{t,i} / Σ_j s_{t,j}``.

``moe_route`` on the ``train`` platform is the reference's routing, recorded while :func:`recording` is active.
``moe_experts_grouped`` runs each expert's rows as one GEMM pair in the activation dtype; with ``fake_mxfp4``
on, the expert weights pass through MXFP4 quantisation with a straight-through gradient (quantisation-aware
training for the checkpoint's MXFP4 experts).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dayzero.ops.moe.reference import _activation, route
from dayzero.ops.registry import register
from dayzero.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from dayzero.train.batch import take
from dayzero.train.fused import grouped_mm_ready, silu_and_mul_train


@dataclass
class Routed:
    logits: torch.Tensor  # [T, E] router logits (with their graph)
    ids: torch.Tensor  # [T, k] chosen experts
    kind: str


_RECORD: list[Routed] | None = None
_FAKE_MXFP4 = False


@contextlib.contextmanager
def recording():
    """Collect every ``moe_route`` call of the block on the ``train`` platform, in layer order."""
    global _RECORD
    prev, _RECORD = _RECORD, []
    try:
        yield _RECORD
    finally:
        _RECORD = prev


def set_fake_mxfp4(on: bool) -> None:
    global _FAKE_MXFP4
    _FAKE_MXFP4 = on


@register("moe_route", "train", note="the reference's routing, recorded for the balance loss and bias update")
def route_train(logits, top_k, kind="sigmoid", correction_bias=None, *args, **kwargs):
    weights, ids = route(logits, top_k, kind, correction_bias, *args, **kwargs)
    if _RECORD is not None:
        _RECORD.append(Routed(logits, ids, kind))
    return weights, ids


def fake_mxfp4(w: torch.Tensor) -> torch.Tensor:
    """w rounded through MXFP4 along its input dim, with the identity as its gradient."""
    with torch.no_grad():
        q = dequantize_mxfp4(*quantize_mxfp4(w), w.dtype)
    return w + (q - w).detach()


@register("moe_experts_grouped", "train", note="one grouped GEMM a projection over the experts' rows (CUDA, bf16), "
                                            "else one batched GEMM pair over the rows padded to the largest "
                                            "expert's count; optional MXFP4 QAT")
def grouped_mlp_train(xs, offsets, w1, w2, activation="silu", b1=None, b2=None, limit=None, order=None, top_k=1):
    # xs: [T, L] tokens (with order) or [N, L] rows by expert; offsets: [E] row ends -> [N, L] rows by expert
    act = _activation(activation, w1, w2, limit)
    if activation == "silu" and limit is None:
        act = silu_and_mul_train  # fla's SwiGLU kernel where it runs
    if _FAKE_MXFP4:
        w1, w2 = fake_mxfp4(w1), fake_mxfp4(w2)
    E = w1.shape[0]
    N = order.shape[0] if order is not None else xs.shape[0]
    src = order // top_k if order is not None else torch.arange(N, device=xs.device)  # [N] row of xs per sorted row
    ends = offsets.long()
    dt = torch.get_autocast_dtype(xs.device.type) if torch.is_autocast_enabled(xs.device.type) else xs.dtype
    if E and N and grouped_mm_ready(xs, dt):
        return _grouped_rows(xs, src, ends, w1, w2, act, b1, b2, dt)
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    # the host reads the padded width (one synchronisation a layer)
    cap, routed = torch.stack(((ends - starts).max(), ends[-1])).tolist() if E else (0, 0)
    if routed < N:  # rows past the last expert's are padding: zero, as in the reference
        y = grouped_mlp_train(xs, offsets, w1, w2, activation, b1, b2, limit,
                              None if order is None else order[:routed], top_k) if order is not None else \
            grouped_mlp_train(xs[:routed], offsets, w1, w2, activation, b1, b2, limit)
        return torch.cat((y, y.new_zeros(N - routed, y.shape[1])))
    if N == 0 or cap == 0:
        return xs.new_zeros(N, w2.shape[-2])
    expert = torch.searchsorted(ends, torch.arange(N, device=xs.device), right=True)
    cells = expert * cap + torch.arange(N, device=xs.device) - starts[expert]  # [N] cell of each sorted row
    # [E, cap] token row of each cell; cells past an expert's count read row 0 and are never read back
    gather = torch.zeros(E * cap, dtype=torch.int64, device=xs.device).index_copy_(0, cells, src)
    x = take(xs, gather).to(dt).view(E, cap, -1)  # [E, cap, L]
    h = torch.bmm(x, w1.to(dt).transpose(1, 2))  # [E, cap, r*I]
    if b1 is not None:
        h = h + b1[:, None, :].to(h.dtype)
    y = torch.bmm(act(h).to(dt), w2.to(dt).transpose(1, 2))  # [E, cap, L]
    if b2 is not None:
        y = y + b2[:, None, :].to(y.dtype)
    return take(y.reshape(E * cap, -1), cells).to(xs.dtype)


def _grouped_rows(xs, src, ends, w1, w2, act, b1, b2, dt) -> torch.Tensor:
    """The experts over the rows as sorted, one grouped GEMM a projection (``torch._grouped_mm``, each expert's
    rows a group): no padding to the largest expert, no host read. Rows past the last expert's end (padding, zero
    out) join the last group and are zeroed after, so every row the GEMMs touch holds real data."""
    N, E = src.shape[0], w1.shape[0]
    offs = torch.cat((ends[:-1], ends.new_full((1,), N))).to(torch.int32)
    x = take(xs, src).to(dt)  # [N, L]
    expert = None
    if b1 is not None or b2 is not None:
        expert = torch.searchsorted(ends, torch.arange(N, device=xs.device), right=True).clamp_(max=E - 1)
    h = torch._grouped_mm(x, w1.to(dt).transpose(1, 2), offs=offs)  # [N, r*I]
    if b1 is not None:
        h = h + take(b1, expert).to(h.dtype)
    y = torch._grouped_mm(act(h).to(dt), w2.to(dt).transpose(1, 2), offs=offs)  # [N, L]
    if b2 is not None:
        y = y + take(b2, expert).to(y.dtype)
    routed = torch.arange(N, device=xs.device) < ends[-1]
    return torch.where(routed[:, None], y, torch.zeros((), dtype=y.dtype, device=y.device)).to(xs.dtype)


def _scores(r: Routed) -> torch.Tensor:
    x = r.logits.float()
    if r.kind == "sigmoid":
        return torch.sigmoid(x)
    if r.kind == "sqrtsoftplus":
        return torch.nn.functional.softplus(x).sqrt()
    return x.softmax(-1)


def balance_loss(routes: list[Routed], seq_of_row: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """The sequence-wise balance loss Σ_i f_i P_i, averaged over the sequences and the layers (times E so that a
    perfectly balanced router scores 1 whatever the expert count); multiply by α."""
    if not routes:
        return torch.zeros((), device=seq_of_row.device)
    total = 0.0
    for r in routes:
        T, E = r.logits.shape
        k = r.ids.shape[1]
        s = _scores(r)
        s = s / s.sum(-1, keepdim=True).clamp_min(1e-20)  # [T, E]
        tokens = torch.zeros(num_seqs, device=s.device).index_add_(0, seq_of_row, torch.ones(T, device=s.device))
        chosen = torch.zeros(T, E, device=s.device).scatter_(1, r.ids, 1.0)
        f = torch.zeros(num_seqs, E, device=s.device).index_add_(0, seq_of_row, chosen) * E / (k * tokens[:, None])
        P = torch.zeros(num_seqs, E, device=s.device).index_add_(0, seq_of_row, s) / tokens[:, None]
        total = total + (f * P).sum(-1).mean()
    return total / len(routes)


@torch.no_grad()
def update_bias(moe_layers: list, routes: list[Routed], rate: float) -> torch.Tensor:
    """Move each layer's selection bias towards balance by its step's loads (``b += rate · sign(mean − load)``);
    returns the worst layer's max load / mean load, on the device (nothing here reads back to the host)."""
    ratios = []
    for moe, r in zip(moe_layers, routes):
        E = moe.spec.n_experts
        ids = r.ids.reshape(-1)
        load = torch.zeros(E, device=ids.device).index_add_(0, ids, torch.ones(ids.numel(), device=ids.device))
        mean = load.mean()
        if moe.e_score_correction_bias is not None:
            moe.e_score_correction_bias.add_(rate * torch.sign(mean - load))
        ratios.append(load.max() / mean.clamp_min(1e-9))
    return torch.stack(ratios).max() if ratios else torch.zeros(())
