"""Attention over the paged caches for the whole step: one call per layer, every sequence of the batch.

The batch-wide contract (every implementation): ``q`` holds the query rows of every sequence of the step
(``batch`` says which rows are whose, their positions, and each sequence's block table); keys are read from
the layer's pools through the block tables; the output has one row per query row.

- ``paged_attention``: GQA/MQA with optional sliding window and sinks (``attention``'s math).
- ``paged_mla``: MLA over the latent cache; single-token (decode) sequences in the absorbed form, prefill
  chunks in the naive form; with ``selection`` [T, topk] (DSA: key positions, -1 padded) each query reads
  only its selected keys.

These references run one sequence at a time with the per-sequence ops of ``reference.py`` / ``mla.py``;
they read host lengths, so they run eagerly (``cuda.py`` has the decode steps on the device).
"""
from __future__ import annotations

import torch

from dayzero.cache.rows import read_rows, row_shape
from dayzero.ops.attention.mla import mla_absorbed, mla_naive
from dayzero.ops.attention.reference import attention, indices_to_mask
from dayzero.ops.registry import register


@register("paged_attention")
def paged_attention(q: torch.Tensor, k_cache, v_cache, batch, scale: float, sinks: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    # q: [T, H, Dqk]; k_cache / v_cache: paged pools of [Hkv, D] rows -> [T, H, Dv] in q's dtype
    out = q.new_zeros(q.shape[0], q.shape[1], row_shape(v_cache)[-1])
    for b in range(batch.num_seqs):
        rows, slots = batch.rows(b), batch.key_slots(b)
        out[rows] = attention(q[rows], read_rows(k_cache, slots), read_rows(v_cache, slots), batch.positions[rows],
                              scale, None, sinks, window)
    return out


@register("paged_mla")
def paged_mla(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache, kv_b_weight: torch.Tensor, v_head_dim: int,
              batch, scale: float, sinks: torch.Tensor | None = None,
              selection: torch.Tensor | None = None) -> torch.Tensor:
    # q_nope: [T, H, N]; q_pe: [T, H, P]; latent_cache: paged [R+P] rows; kv_b_weight: [H*(N+V), R] dense
    # selection: [T, topk] int64 key positions (-1 padding) or None (every causal key) -> [T, H, V]
    T, H, _ = q_nope.shape
    out = q_nope.new_zeros(T, H, v_head_dim)
    for b in range(batch.num_seqs):
        rows, slots = batch.rows(b), batch.key_slots(b)
        mask = None if selection is None else indices_to_mask(selection[rows], slots.shape[0])
        form = mla_absorbed if rows.stop - rows.start == 1 else mla_naive
        out[rows] = form(q_nope[rows], q_pe[rows], read_rows(latent_cache, slots), kv_b_weight, v_head_dim,
                         batch.positions[rows], scale, mask, sinks)
    return out
