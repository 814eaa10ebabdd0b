"""The DSA indexer's decode step on the device: every sequence's one query scored against every key of its
block table at once ([B, key width] scores, fp32), causal mask by the query's position, top-k into the step's
selection buffer. No host length is read, so it runs inside captured CUDA graphs; prefill rows are refused
(the per-sequence reference runs them)."""
from __future__ import annotations

import torch

from dayzero.cache.rows import read_rows
from dayzero.ops.attention.cuda import _decode_only, key_positions
from dayzero.ops.indexer.reference import _scores_rows
from dayzero.ops.registry import register
from dayzero.cache.rows import slots_of


@register("paged_indexer_topk", "cuda", verifier=lambda q, w, kc, batch, *a, **k: _decode_only(batch),
          note="decode rows batched over the block tables (PyTorch); prefill rows use the reference")
def paged_indexer_topk_decode(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, topk: int,
                              out: torch.Tensor) -> torch.Tensor:
    # q: [B, Hi, Di]; weights: [B, Hi]; out: [B, topk]
    kp, ok = key_positions(batch)  # [B, W]
    k = read_rows(k_cache, slots_of(batch.block_tables, kp, batch.block_size))  # [B, W, Di]
    scores = _scores_rows(q, weights, k).masked_fill_(~ok, float("-inf"))  # [B, W]
    kk = min(topk, scores.shape[1])
    _, idx = torch.topk(scores, kk, dim=-1, sorted=True)  # the causal (finite) keys first
    n_valid = (batch.positions + 1)[:, None]
    out[:, :kk] = torch.where(torch.arange(kk, device=q.device) < n_valid, idx, -1)
    out[:, kk:] = -1
    return out
