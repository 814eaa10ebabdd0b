"""Causal softmax attention over one sequence: GQA/MQA, sliding window, key masks, softmax sinks.

The caller loops over sequences. Keys are the sequence's tokens 0..S-1 (key s has position s);
queries are a contiguous run of its newest tokens with explicit positions ``q_pos``. Query t may
read key s when

    s <= q_pos[t]  and  (window is None or s > q_pos[t] - window)  and  (key_mask is None or key_mask[t, s])

Scores, softmax and the weighted sum are fp32 whatever the input dtype; the output is in q's dtype.
Queries are processed in blocks so the [H, rows, keys] score matrix stays bounded for long prompts.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register

# Upper bound on score-matrix elements per query block (fp32: 256 MiB). The rows per block are
# cut so that rows * H * keys stays under it, with at least one row and at most MAX_Q_BLOCK.
SCORE_BUDGET = 1 << 26
MAX_Q_BLOCK = 256


def q_block_rows(heads: int, keys: int, q_block: int | None = None) -> int:
    """Query rows per block: ``q_block`` if given, else as many as SCORE_BUDGET allows (1..MAX_Q_BLOCK)."""
    if q_block is not None:
        return max(1, q_block)
    return max(1, min(MAX_Q_BLOCK, SCORE_BUDGET // max(1, heads * keys)))


def key_range(pos: torch.Tensor, num_keys: int, window: int | None) -> tuple[int, int]:
    """Keys [lo, hi) that any query of a block with CPU positions ``pos`` may read (causal + window)."""
    hi = min(num_keys, int(pos.max()) + 1)
    lo = 0 if window is None else max(0, int(pos.min()) - window + 1)
    return lo, max(lo, hi)


def sink_softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised softmax weights over the last dim and their denominator, ``(p, denom)``: fp32 ``scores``
    with -inf at keys not read; ``sink`` (broadcasting to ``scores[..., :1]``) adds e^sink to the denominator
    only. A row with no key and no sink gets p = 0 and a denominator of tiny (so p / denom = 0)."""
    m = scores.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.expand_as(m))
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # no key (and no sink): any finite m gives p = 0
    p = torch.exp(scores - m)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    return p, denom.clamp_min(torch.finfo(torch.float32).tiny)


@register("attention")
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    scale: float,
    key_mask: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    *,
    q_block: int | None = None,
) -> torch.Tensor:
    # q: [Tq, H, Dqk]; k: [S, Hkv, Dqk]; v: [S, Hkv, Dv]; q_pos: [Tq] int64
    # key_mask: [Tq, S] bool; sinks: [H] logits (gpt-oss / HY-V4 style); returns [Tq, H, Dv]
    Tq, H, Dqk = q.shape
    S, Hkv, Dv = v.shape
    assert k.shape == (S, Hkv, Dqk), f"k {tuple(k.shape)} does not match q {tuple(q.shape)} / v {tuple(v.shape)}"
    assert H % Hkv == 0, f"{H} query heads are not a multiple of {Hkv} kv heads"
    assert key_mask is None or key_mask.shape == (Tq, S), f"key_mask {tuple(key_mask.shape)} is not [{Tq}, {S}]"
    G = H // Hkv
    out = torch.zeros(Tq, H, Dv, dtype=q.dtype, device=q.device)
    if Tq == 0 or S == 0:
        return out

    # kf: [Hkv, S, Dqk], vf: [Hkv, S, Dv]; fp32 so scores and the weighted sum are fp32
    kf = k.float().transpose(0, 1)
    vf = v.float().transpose(0, 1)
    sink = None if sinks is None else sinks.float().view(H, 1)
    # One host copy of the positions to cut each block's key range (a single sync per call).
    pos_host = q_pos.cpu()
    rows = q_block_rows(H, S, q_block)

    for t0 in range(0, Tq, rows):
        t1 = min(Tq, t0 + rows)
        B = t1 - t0
        lo, hi = key_range(pos_host[t0:t1], S, window)
        if hi == lo:  # no query of this block can read any key: its rows stay zero
            continue
        pos = q_pos[t0:t1, None]
        s_idx = torch.arange(lo, hi, device=q.device)
        allowed = s_idx <= pos  # [B, Sb]
        if window is not None:
            allowed &= s_idx > pos - window
        if key_mask is not None:
            allowed &= key_mask[t0:t1, lo:hi]

        # head h = kv_head * G + g reads kv head h // G; group the G query heads of a kv head as rows
        qb = q[t0:t1].float().view(B, Hkv, G, Dqk).permute(1, 2, 0, 3).reshape(Hkv, G * B, Dqk)
        scores = torch.matmul(qb, kf[:, lo:hi].transpose(1, 2)).mul_(scale)  # [Hkv, G*B, Sb]
        scores = scores.view(H, B, hi - lo).masked_fill_(~allowed, float("-inf"))

        p, denom = sink_softmax(scores, None if sink is None else sink[:, :, None])  # [H, B, Sb], [H, B, 1]
        o = torch.matmul(p.view(Hkv, G * B, hi - lo), vf[:, lo:hi])  # [Hkv, G*B, Dv]
        o = o.view(H, B, Dv) / denom
        out[t0:t1] = o.permute(1, 0, 2).to(q.dtype)
    return out


def indices_to_mask(indices: torch.Tensor, S: int) -> torch.Tensor:
    """[Tq, k] int64 key indices padded with -1 -> [Tq, S] bool mask, True at the listed keys."""
    Tq = indices.shape[0]
    # Padding (-1) is sent to an extra column S that is dropped afterwards.
    idx = torch.where(indices < 0, torch.full_like(indices, S), indices)
    mask = torch.zeros(Tq, S + 1, dtype=torch.bool, device=indices.device)
    mask.scatter_(1, idx, True)
    return mask[:, :S]


# Registers mla_naive / mla_absorbed; at the end because mla.py imports attention from here.
from dayzero.ops.attention import mla as _mla  # noqa: F401,E402
from dayzero.ops.attention import compressed as _compressed  # noqa: F401,E402
