"""The DSA indexer's decode step on the device: every sequence's one query scored against every key of its
block table at once ([B, key width] scores, fp32), causal mask by the query's position, top-k into the step's
selection buffer. The scores come from the Triton kernel of ``triton_indexer.py`` where it can run (its
``refusal`` says why not: no Triton, a quantised key pool, ...), else from a PyTorch gather. No host length
is read, so it runs inside captured CUDA graphs. Prefill rows take the kernel's varlen form, each row scored
against its sequence's keys (``batch.seq_of_row``) in chunks whose scratch stays under the budget the cache
plan counts; where it cannot run the per-sequence reference does. ``paged_indexer_scores`` (the partial scores of
a tensor-parallel rank's heads, summed over the ranks before the top-k) runs the same kernels."""
from __future__ import annotations

import torch

from dayzero.cache.rows import read_rows, slots_of
from dayzero.ops.attention.cuda import NOT_DECODE, key_positions
from dayzero.ops.indexer import triton_indexer
from dayzero.ops.indexer.reference import _scores_rows
from dayzero.ops.registry import register


def _verify(q, weights, k_cache, batch, *a, **k) -> str | None:
    if batch.is_decode:
        return None
    why = triton_indexer.refusal(q, weights, k_cache)
    return None if why is None else f"{NOT_DECODE} ({why})"


@register("paged_indexer_topk", "cuda", verifier=_verify,
          note="decode rows batched over the block tables (Triton scores, else PyTorch); prefill rows by the "
               "Triton varlen form in chunks of bounded scratch (else the reference)")
def paged_indexer_topk_decode(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, topk: int,
                              out: torch.Tensor) -> torch.Tensor:
    # q: [T, Hi, Di]; weights: [T, Hi]; out: [T, topk]
    if not batch.is_decode:  # the verifier let these through only with the Triton kernel
        return triton_indexer.varlen_topk(q, weights, k_cache, batch.block_tables, batch.seq_of_row,
                                          batch.positions, batch.block_size, topk, out)
    if triton_indexer.refusal(q, weights, k_cache) is None:
        scores = triton_indexer.decode_scores(q, weights, k_cache, batch.block_tables, batch.positions,
                                              batch.block_size)  # [B, W]
    else:
        scores = decode_scores_torch(q, weights, k_cache, batch)
    return triton_indexer.topk_of_scores(scores, batch.positions, topk, out)


def _verify_scores(q, weights, k_cache, batch, out, start=0) -> str | None:
    why = triton_indexer.refusal(q, weights, k_cache)
    if why is None and (out.dtype != torch.float32 or out.stride(-1) != 1 or out.shape[1] != batch.key_width):
        return "the scores must be fp32 rows of the batch's key width"
    return why


@register("paged_indexer_scores", "cuda", verifier=_verify_scores,
          note="Triton (decode rows and prefill rows alike, each against its sequence's block table), no host read")
def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, out: torch.Tensor,
                         start: int = 0) -> torch.Tensor:
    # q: [T, Hi, Di]; weights: [T, Hi]; out: [rows, key width] for the step's rows start .. start + rows. Under
    # tensor parallelism a rank's heads give partial scores, summed over the ranks before the top-k.
    rows = slice(start, start + out.shape[0])
    if batch.is_decode and start == 0 and out.shape[0] == batch.num_seqs:
        return triton_indexer.decode_scores(q, weights, k_cache, batch.block_tables, batch.positions,
                                            batch.block_size, out)
    return triton_indexer.varlen_scores(q[rows], weights[rows], k_cache, batch.block_tables, batch.seq_of_row[rows],
                                        batch.positions[rows], batch.block_size, out)


def paged_indexer_topk_decode_torch(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, topk: int,
                                    out: torch.Tensor) -> torch.Tensor:
    """``paged_indexer_topk_decode`` on its PyTorch path whatever the device (tests, benchmarks)."""
    return triton_indexer.topk_of_scores(decode_scores_torch(q, weights, k_cache, batch), batch.positions, topk, out)


def decode_scores_torch(q: torch.Tensor, weights: torch.Tensor, k_cache, batch) -> torch.Tensor:
    """Masked fp32 scores [B, key width] by gathering every row's keys through its block table."""
    kp, ok = key_positions(batch)  # [B, W]
    k = read_rows(k_cache, slots_of(batch.block_tables, kp, batch.block_size))  # [B, W, Di]
    return _scores_rows(q, weights, k).masked_fill_(~ok, float("-inf"))
