"""DSA lightning indexer (DeepSeek-V3.2): per-query scores over the sequence's keys and causal top-k.

    I[t, s] = sum_h weights[t, h] * ReLU(q[t, h] . k[s])      for s <= q_pos[t], else -inf

q already carries the indexer RoPE and ``weights`` already carries every scale factor
(weights_proj output * Hi^-1/2 * Di^-1/2 and, in FP8 mode, the query's quantisation scale).
This is the engine's high-precision path: plain fp32, no quantisation. The FP8 path (Hadamard
rotation of q and k, then e4m3 quantisation per 128 values with ue8m0 scales, the key scale
multiplied into the score) is a later precision mode.

The score is a sum over heads, so the scores of disjoint sets of heads add up to the scores of all. Under
tensor parallelism a rank holds some of the heads: ``paged_indexer_scores`` gives its partial scores, the ranks
sum them, and ``indexer_topk_of_scores`` takes every rank's (identical) top-k of the sums.
"""
from __future__ import annotations

import torch

from dayzero.ops.attention.reference import key_range, q_block_rows
from dayzero.ops.indexer.triton_indexer import topk_of_scores
from dayzero.ops.registry import register


def _block_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    # q: [B, Hi, Di]; weights: [B, Hi]; k: [Sb, Di] (keys 0..Sb-1); pos: [B] -> masked scores [B, Sb] fp32
    logits = torch.einsum("bhd,sd->bhs", q.float(), k.float()).relu_()
    scores = torch.einsum("bhs,bh->bs", logits, weights.float())
    future = torch.arange(k.shape[0], device=k.device) > pos[:, None]
    return scores.masked_fill_(future, float("-inf"))


def _scores_rows(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # q: [B, Hi, Di]; weights: [B, Hi]; k: [B, S, Di] (each row's own keys) -> unmasked scores [B, S] fp32
    logits = torch.einsum("bhd,bsd->bhs", q.float(), k.float()).relu_()
    return torch.einsum("bhs,bh->bs", logits, weights.float())


@register("indexer_scores")
def indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, *, q_block: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full masked fp32 score matrix [Tq, S] (into ``out`` when given; tools, tests and the tensor-parallel
    scores; the engine's one-rank path uses indexer_topk)."""
    Tq, Hi, _ = q.shape
    S = k.shape[0]
    if out is None:
        out = torch.full((Tq, S), float("-inf"), dtype=torch.float32, device=q.device)
    rows = q_block_rows(Hi, S, q_block)
    for t0 in range(0, Tq, rows):
        t1 = min(Tq, t0 + rows)
        out[t0:t1] = _block_scores(q[t0:t1], weights[t0:t1], k, q_pos[t0:t1])
    return out


@register("indexer_topk")
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    q_pos: torch.Tensor,
    topk: int,
    *,
    q_block: int | None = None,
) -> torch.Tensor:
    """Indices [Tq, topk] int64 of each query's top min(topk, q_pos+1) causal keys (any order), -1 padded."""
    # q: [Tq, Hi, Di]; weights: [Tq, Hi]; k: [S, Di]; q_pos: [Tq] int64
    Tq, Hi, _ = q.shape
    S = k.shape[0]
    out = torch.full((Tq, topk), -1, dtype=torch.int64, device=q.device)
    if Tq == 0 or S == 0 or topk == 0:
        return out
    pos_host = q_pos.cpu()  # one sync per call, to cut each block's keys at its last position
    rows = q_block_rows(Hi, S, q_block)
    for t0 in range(0, Tq, rows):
        t1 = min(Tq, t0 + rows)
        _, hi = key_range(pos_host[t0:t1], S, None)
        if hi == 0:
            continue
        pos = q_pos[t0:t1]
        scores = _block_scores(q[t0:t1], weights[t0:t1], k[:hi], pos)  # [B, hi]
        kk = min(topk, hi)
        # sorted=True puts the finite (causal) scores first, so slot j is a real key iff j < q_pos+1
        _, idx = torch.topk(scores, kk, dim=-1, sorted=True)
        n_valid = (pos + 1).clamp(0, hi)[:, None]
        slot = torch.arange(kk, device=q.device)
        out[t0:t1, :kk] = torch.where(slot < n_valid, idx, torch.full_like(idx, -1))
    return out


@register("indexer_topk_rows")
def indexer_topk_rows(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, valid: torch.Tensor,
                      topk: int) -> torch.Tensor:
    """One query per sequence, all sequences at once (decode): q [B, Hi, Di]; weights [B, Hi]; k [B, S, Di]
    (each sequence's keys, padded); valid [B, S] bool. Returns [B, topk] int64: the top min(topk, valid keys)
    keys of each row (any order), -1 padded; per row it is ``indexer_topk`` over that row's valid keys."""
    B, S = valid.shape
    out = torch.full((B, topk), -1, dtype=torch.int64, device=q.device)
    if B == 0 or S == 0 or topk == 0:
        return out
    scores = _scores_rows(q, weights, k).masked_fill_(~valid, float("-inf"))
    kk = min(topk, S)
    _, idx = torch.topk(scores, kk, dim=-1, sorted=True)  # valid keys first
    n_valid = valid.sum(-1, keepdim=True)
    out[:, :kk] = torch.where(torch.arange(kk, device=q.device) < n_valid, idx, torch.full_like(idx, -1))
    return out


@register("paged_indexer_scores")
def paged_indexer_scores(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, out: torch.Tensor,
                         start: int = 0) -> torch.Tensor:
    """Masked fp32 scores of the step's query rows ``start .. start + len(out)`` into ``out`` [rows, key width]
    (returned): ``out[i, s]`` is the score of key position s of row t = start + i's own sequence for
    s <= positions[t], -inf elsewhere (past the position, past the sequence). q: [T, Hi, Di]; weights: [T, Hi]
    (the whole step's rows). Scores over a subset of the heads are partial scores: they sum to the whole."""
    from dayzero.cache.rows import read_rows

    out.fill_(float("-inf"))
    stop = start + out.shape[0]
    for b in range(batch.num_seqs):
        rows = batch.rows(b)
        lo, hi = max(rows.start, start), min(rows.stop, stop)
        if lo >= hi:
            continue
        k = read_rows(k_cache, batch.key_slots(b))  # [n, Di]
        indexer_scores(q[lo:hi], weights[lo:hi], k, batch.positions[lo:hi], out=out[lo - start:hi - start, :len(k)])
    return out


# Top-k of masked scores [T, W] per row, -1 past the row's causal keys: plain PyTorch, kept beside the Triton
# scores it follows on the GPU.
register("indexer_topk_of_scores")(topk_of_scores)


@register("paged_indexer_topk")
def paged_indexer_topk(q: torch.Tensor, weights: torch.Tensor, k_cache, batch, topk: int,
                       out: torch.Tensor) -> torch.Tensor:
    """The whole step's DSA selection into ``out`` [T, topk] (returned): for every query row, the key positions
    of its top min(topk, position+1) causal keys of its own sequence (any order), -1 padded. A sequence no
    longer than ``topk`` selects every causal key without scoring them (the same set the scores would give).
    q: [T, Hi, Di]; weights: [T, Hi]; k_cache: the paged indexer-key pool."""
    from dayzero.cache.rows import read_rows

    for b in range(batch.num_seqs):
        rows, n = batch.rows(b), batch.seq_lens[b]
        if n <= topk:
            causal = torch.arange(topk, device=q.device) <= batch.positions[rows, None]  # [Tq, topk]
            out[rows] = torch.where(causal, torch.arange(topk, device=q.device), -1)
        else:
            k = read_rows(k_cache, batch.key_slots(b))
            out[rows] = indexer_topk(q[rows], weights[rows], k, batch.positions[rows], topk)
    return out
