"""A DSA / MLA layer's cache rows of a step's tokens, normalised, rotated and written, each in one op.

The compressed KV ``c_kv`` [T, R] goes through the latent RMSNorm, the shared rope key ``k_pe`` [T, P] through
the rotary, and ``[norm(c_kv) | rope(k_pe)]`` is written at each token's slot of the latent pool: four kernels
by the ops apart (norm, rotary, concatenation, scatter), one in :mod:`dayzero.ops.attention.latent_kernels`.
Likewise the indexer's key (``indexer_key_write``): LayerNorm, the rotary of its rope channels, the scatter into
the indexer-key pool (three kernels apart). A DSA layer's step runs both writes and the rotary of its query's rope
channels as one op (``mla_step_rows``, one launch on a GPU). Same rounding as apart: each part in the input's
dtype, then the pool's. The compositions call the norm and rotary ops, so where the one kernel refuses (a
quantised pool) each part still runs its best implementation.
"""
from __future__ import annotations

import torch

from dayzero.cache.rows import write_rows
from dayzero.ops.registry import call, register


@register("mla_latent_write")
def mla_latent_write(c_kv: torch.Tensor, weight: torch.Tensor, eps: float, k_pe: torch.Tensor,
                     cos: torch.Tensor | None, sin: torch.Tensor | None, interleaved: bool, pool,
                     slots: torch.Tensor) -> None:
    # c_kv: [T, R]; weight: [R]; k_pe: [T, P]; cos, sin: [T, P/2] (None: no rotary); slots: [T] -> pool rows
    k = k_pe if cos is None else call("rotary", k_pe[:, None], cos, sin, interleaved)[:, 0]
    write_rows(pool, slots, torch.cat((call("rms_norm", c_kv, weight, eps)[0], k), dim=-1))


@register("indexer_key_write")
def indexer_key_write(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, interleaved: bool, start: int | None, pool, slots: torch.Tensor) -> None:
    # k: [T, D]; weight, bias: [D]; cos, sin: [T, half]; rotates channels start .. start + 2·half of the normed key
    # (all of them when start is None); slots: [T] -> pool rows
    y = call("rotary", call("layer_norm", k, weight, bias, eps)[:, None], cos, sin, interleaved, start=start)
    write_rows(pool, slots, y[:, 0])


@register("mla_step_rows")
def mla_step_rows(q_pe: torch.Tensor, c_kv: torch.Tensor, weight: torch.Tensor, eps: float, k_pe: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, pool, slots: torch.Tensor,
                  index: tuple | None = None) -> torch.Tensor:
    # q_pe: [T, H, P] (the query heads' rope channels) -> rotated [T, H, P]; the latent rows written as
    # mla_latent_write writes them, with the same rotary; index: (k, weight, bias, eps, cos, sin, interleaved,
    # start, pool) of indexer_key_write at the same slots, or None
    q = call("rotary", q_pe, cos, sin, interleaved)
    call("mla_latent_write", c_kv, weight, eps, k_pe, cos, sin, interleaved, pool, slots)
    if index is not None:
        call("indexer_key_write", *index, slots)
    return q
