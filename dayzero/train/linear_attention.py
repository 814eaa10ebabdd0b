"""Training implementations of the KDA layer's pooled ops (the ``train`` platform): every sequence of a
:class:`~dayzero.train.batch.TrainBatch` starts from zero state, nothing is written back, autograd runs through.

- ``causal_conv1d_pooled``: fla-core's varlen causal conv (:mod:`dayzero.train.fused`), else the depthwise
  causal conv over the flat rows as W shifted taps, each tap masked where it would reach before its sequence's
  first token (the zero window of a fresh sequence).
- ``kda_pooled``: fla-core's ``chunk_kda`` over the packed rows (``cu_seqlens``) on CUDA, which has a backward;
  elsewhere (or without fla) the chunk form of ``dayzero/ops/kda/reference.py`` batched over the batch's length
  buckets, with the forward substitution done by a triangular solve (the reference's substitution writes its
  rows in place, which autograd cannot differentiate).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.fla_import import limit_fla_autotuning, quiet_fla_import
from dayzero.ops.kda.chunk_batched import kda_chunk_batched
from dayzero.ops.kda.reference import _prep, grouped, kda_gate
from dayzero.ops.registry import register
from dayzero.train import fused

try:  # fla-core: Triton kernels with a backward (optional, GPU only)
    with quiet_fla_import():
        from fla.ops.kda import chunk_kda
except Exception:  # noqa: BLE001 - absent, or a triton it cannot use: the PyTorch chunk form runs
    chunk_kda = None


@register("causal_conv1d_pooled", "train", note="shifted taps over the packed rows, zero window, autograd-safe")
def causal_conv1d_train(x, weight, window_pool, batch, activation: str | None = "silu", groups: int = 1,
                        reset=None):
    # x: [T, C]; weight: [C, W] (or [C, 1, W]) -> y [T, C] in x.dtype (groups G: [G, T, C/G]); training starts
    # every sequence from zero state and keeps no pools, so ``reset`` has nothing to zero
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    T, C = x.shape
    if fused.ready(x):
        return grouped(fused.causal_conv1d(x, weight.reshape(C, -1), batch, activation), groups)
    w = weight.reshape(C, -1).float()
    W = w.shape[1]
    xp = F.pad(x.float(), (0, 0, W - 1, 0))  # [W-1+T, C]: row t+W-1 is token t
    y = xp[W - 1:] * w[:, W - 1]
    for j in range(W - 1):  # tap j reads the token W-1-j rows back, absent before the sequence's start
        back = W - 1 - j
        y = y + (xp[j:j + T] * w[:, j]) * (batch.positions >= back)[:, None]
    if activation == "silu":
        y = F.silu(y)
    return grouped(y.to(x.dtype), groups)


def fla_available(t: torch.Tensor) -> bool:
    return chunk_kda is not None and t.is_cuda


@register("kda_pooled", "train", note="fla-core chunk_kda (CUDA) or the batched chunk form, zero initial state")
def kda_train(q, k, v, g, beta, scale: float, state_pool, batch, use_qk_l2norm: bool = True,
              gate: tuple | None = None, zeroed: bool = False):
    # q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H] -> o [T, H, V] in v.dtype; gate: as the reference's
    if gate is not None:
        g, beta = kda_gate(g, *gate), torch.sigmoid(beta.float())
    if fla_available(q):
        limit_fla_autotuning()
        cu_host = getattr(batch, "cu_seqlens_cpu", None)
        if cu_host is None:
            cu_host = torch.tensor(batch.query_start, dtype=torch.int64)
        o, _ = chunk_kda(q[None].contiguous(), k[None].contiguous(), v[None].contiguous().to(q.dtype),
                         g[None].float().contiguous(), beta[None].float().contiguous(), scale=scale,
                         initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=use_qk_l2norm,
                         cu_seqlens=batch.cu_seqlens, cu_seqlens_cpu=cu_host)
        return o[0].to(v.dtype)
    xs = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    pieces = zip(*(batch.split(x) for x in xs))
    outs = [b.unpad(kda_chunk_batched(*(b.pad(x) for x in piece))[0]) for b, piece in zip(batch.buckets, pieces)]
    return torch.cat(outs).to(v.dtype)
