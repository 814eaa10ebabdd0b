"""Training implementations of the attention ops (the ``train`` platform) and the DSA indexer's loss.

Each runs once per length bucket of the :class:`~dayzero.train.batch.TrainBatch` (a padded ``[B, L]`` layout)
through ``scaled_dot_product_attention``: causal without a mask (flash / memory-efficient kernels) for dense
attention, with a boolean mask of the indexer's top-k for the sparse buckets. The keys are the rows the layer
wrote to its :class:`~dayzero.train.batch.RowsPool` this step.

- ``paged_mla``: MLA in the naive form (keys and values expanded from the latent rows by ``kv_b``).
- ``paged_attention``: GQA / MQA, optionally over a sliding window.
- ``paged_indexer_topk``: the indexer's scores ``I[t, s] = Σ_h w[t, h] ReLU(q[t, h]·k[s])`` for the buckets
  longer than its top-k, their top-k (the selection) on a sparse step; on a dense step (the warm-up) it returns
  no selection, so the layer attends densely. Either way it leaves its q, weights and keys on the batch for the
  ``paged_mla`` call that follows, which adds the indexer's KL loss (:func:`indexer_kl`) to ``batch.losses``.

The indexer loss (DeepSeek-V3.2): for query t, the target ``p_t`` is the main attention's distribution summed
over heads and renormalised, over every causal key on a dense step or over the selected keys on a sparse one,
detached; the loss is ``KL(p_t ‖ softmax(I_t))`` over the same keys. The trainer takes its gradient for the
indexer's parameters only, so it never reaches the main model (the indexer's input is detached from the main
loss in effect), and the main loss never reaches the indexer (its selection is not differentiable).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dayzero.ops.registry import register
from dayzero.train.batch import take, to_device

_NEG = float("-inf")
# cuDNN's attention builds a plan for every new shape (~25 ms of host time a call) and every step's buckets have
# new widths: flash (causal) and memory-efficient (masked) kernels only
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


_PROBES: list = []


@contextlib.contextmanager
def probing(fn):
    """Within the block, every attention call of the training forward calls ``fn(q, k, scale, mask, out)`` (``q``
    ``[B, L, H, D]``, ``k`` ``[B, L, Hkv, D]``, ``mask`` ``[B, L, L]`` or None for causal, ``out`` ``[B, L, H, Dv]``)
    after computing ``out``; a tensor it returns replaces ``out``. The recall probe (:mod:`dayzero.train.probe`)
    reads the attention weights through it and zeroes layers' outputs."""
    _PROBES.append(fn)
    try:
        yield
    finally:
        _PROBES.remove(fn)


def _sdpa(q, k, v, scale: float, mask=None) -> torch.Tensor:
    # q: [B, L, H, D]; k: [B, L, Hkv, D]; v: [B, L, Hkv, Dv]; mask: [B, L, L] bool or None (causal)
    q0, k0 = q, k
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves H / Hkv query heads
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    with sdpa_kernel(_BACKENDS):
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
    o = o.transpose(1, 2)
    for fn in _PROBES:
        replaced = fn(q0, k0, scale, mask, o)
        o = o if replaced is None else replaced
    return o


def _causal(L: int, device) -> torch.Tensor:
    return torch.ones(L, L, dtype=torch.bool, device=device).tril()


def selection_mask(selection: torch.Tensor, width: int) -> torch.Tensor:
    """[B, L, topk] key positions (-1 padding) -> [B, L, width] bool, True at the selected keys."""
    idx = torch.where(selection < 0, width, selection)
    mask = torch.zeros(*selection.shape[:-1], width + 1, dtype=torch.bool, device=selection.device)
    return mask.scatter_(-1, idx, True)[..., :width]


def _sparse(batch, bucket, topk: int) -> bool:
    return batch.sparse and bucket.width > topk


@register("paged_mla", "train", note="naive MLA per length bucket through SDPA; top-k masks on sparse buckets")
def paged_mla_train(q_nope, q_pe, latent_cache, kv_b_weight, v_head_dim: int, batch, scale: float, sinks=None,
                    selection=None):
    # q_nope: [T, H, N]; q_pe: [T, H, P]; latent_cache.rows: [T, R+P]; selection: [T, topk] or None -> [T, H, V]
    if sinks is not None:
        raise NotImplementedError("training attention does not support softmax sinks")
    T, H, N = q_nope.shape
    P = q_pe.shape[-1]
    lat = latent_cache.rows
    R = lat.shape[-1] - P
    c, k_pe = lat.split([R, P], dim=-1)
    kv = F.linear(c, kv_b_weight).view(T, H, N + v_head_dim)
    k_nope, v = kv.split([N, v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(T, H, P).to(k_nope.dtype)), dim=-1)  # [T, H, N+P]
    q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)
    pending, batch.pending_indexer = batch.pending_indexer, None
    topk = None if selection is None else selection.shape[1]
    outs = []
    pieces = zip(batch.split(q), batch.split(k), batch.split(v.to(q.dtype)))
    for bucket, (qb, kb, vb) in zip(batch.buckets, pieces):
        qb, kb, vb = bucket.pad(qb), bucket.pad(kb), bucket.pad(vb)
        mask = None
        if selection is not None and bucket.width > topk:
            mask = selection_mask(bucket.pad(selection[bucket.start:bucket.end]), bucket.width)
        outs.append(bucket.unpad(_sdpa(qb, kb, vb, scale, mask)))
        if pending is not None and bucket.width > pending[3]:
            iq, iw, ik = (t[bucket.start:bucket.end] for t in pending[:3])
            batch.add_loss("indexer_kl", indexer_kl(qb, kb, mask, scale, bucket, iq, iw, ik, pending[3],
                                                    batch.kl_rows))
    return torch.cat(outs).to(q_nope.dtype)


@register("paged_attention", "train", note="GQA per length bucket through SDPA")
def paged_attention_train(q, k_cache, v_cache, batch, scale: float, sinks=None, window: int | None = None):
    # q: [T, H, D]; k_cache.rows / v_cache.rows: [T, Hkv, D] -> [T, H, Dv]
    if sinks is not None:
        raise NotImplementedError("training attention does not support softmax sinks")
    k, v = k_cache.rows.to(q.dtype), v_cache.rows.to(q.dtype)
    outs = []
    for bucket, qkv in zip(batch.buckets, zip(batch.split(q), batch.split(k), batch.split(v))):
        mask = None
        if window is not None and bucket.width > window:
            i = torch.arange(bucket.width, device=q.device)
            mask = _causal(bucket.width, q.device) & (i[None, :] > i[:, None] - window)
            mask = mask.expand(bucket.num_seqs, -1, -1)
        outs.append(bucket.unpad(_sdpa(*(bucket.pad(t) for t in qkv), scale, mask)))
    return torch.cat(outs)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q: [B, M, Hi, Di]; w: [B, M, Hi]; k: [B, S, Di] -> unmasked fp32 scores [B, M, S] (the reference's math)."""
    logits = torch.einsum("bmhd,bsd->bmhs", q.float(), k.float()).relu()
    return torch.einsum("bmhs,bmh->bms", logits, w.float())


@register("paged_indexer_topk", "train",
          note="top-k of each long bucket's scores on a sparse step, none on a dense one")
@torch.no_grad()
def paged_indexer_topk_train(q, weights, k_cache, batch, topk: int, out):
    # q: [T, Hi, Di]; weights: [T, Hi]; k_cache.rows: [T, Di]; out: [T, topk] -> the selection, or None (dense)
    batch.pending_indexer = (q, weights, k_cache.rows, topk)
    if not batch.sparse:
        return None
    out.copy_(torch.where(torch.arange(topk, device=q.device) <= batch.positions[:, None],
                          torch.arange(topk, device=q.device), -1))  # short sequences: every causal key
    for bucket in batch.buckets:
        if bucket.width <= topk:
            continue
        part = slice(bucket.start, bucket.end)
        qb, wb, kb = bucket.pad(q[part]), bucket.pad(weights[part]), bucket.pad(k_cache.rows[part])
        causal = _causal(bucket.width, q.device)
        sel = []
        for t0 in range(0, bucket.width, 512):  # query blocks bound the [B, rows, keys] scores
            rows = slice(t0, min(bucket.width, t0 + 512))
            s = indexer_scores(qb[:, rows], wb[:, rows], kb)
            s = s.masked_fill_(~causal[rows], _NEG)
            idx = s.topk(topk, dim=-1).indices  # finite (causal) scores first
            n_valid = (torch.arange(rows.start, rows.stop, device=q.device) + 1)[None, :, None]
            sel.append(torch.where(torch.arange(topk, device=q.device) < n_valid, idx, -1))
        out[bucket.start:bucket.end] = bucket.unpad(torch.cat(sel, 1))
    return out


def indexer_kl(q, k, mask, scale: float, bucket, iq, iw, ik, topk: int, max_rows: int) -> torch.Tensor:
    """The indexer's KL loss over one bucket (sum over its sampled query rows, divided by their number).

    q, k: the main attention's padded [B, L, H, D] queries and keys; mask: [B, L, L] the sparse selection (None:
    dense, every causal key); iq, iw, ik: the indexer's q [n, Hi, Di], weights [n, Hi], keys [n, Di] of the
    bucket's n rows. The
    query rows are those past the top-k (before it every causal key is selected whatever the scores), at most
    ``max_rows`` per sequence, evenly spaced; rows of padding are left out."""
    B, L = q.shape[:2]
    index = bucket.index
    # on the host (on the device, unique would read its output size back: a synchronisation every call)
    rows = torch.linspace(topk, L - 1, min(max_rows, L - topk)).round().long().unique()
    rows = to_device(rows, q.device)
    real = rows[None, :] <= index[:, -1:] - index[:, :1]  # [B, M]: within the sequence, not padding
    keys = torch.arange(L, device=q.device)
    allowed = keys[None, None, :] <= rows[None, :, None]  # [1, M, L] causal
    allowed = allowed & (mask[:, rows] if mask is not None else True)  # [B, M, L]
    with torch.no_grad():  # target: the main attention's distribution, summed over heads
        s = torch.einsum("bmhd,bshd->bhms", q[:, rows].float(), k.float()) * scale
        p = s.masked_fill_(~allowed[:, None], _NEG).softmax(-1).sum(1)  # [B, M, L]
        p = p / p.sum(-1, keepdim=True)
    at = index[:, rows]
    scores = indexer_scores(take(iq, at), take(iw, at), take(ik, index))  # [B, M, L]
    logq = scores.masked_fill(~allowed, _NEG).log_softmax(-1)
    kl = torch.where(allowed, torch.xlogy(p, p) - p * logq.masked_fill(~allowed, 0.0), 0.0).sum(-1)  # [B, M]
    n = real.sum().clamp(min=1)
    return (kl * real).sum() / n
