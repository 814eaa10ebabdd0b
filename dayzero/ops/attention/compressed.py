"""DeepSeek-V4 compressed attention: gated pooling of token windows, and attention over a sliding window
of recent keys joined with compressed entries.

Pooling (``compress_pool``). Each token t carries a projected row ``c_t`` and a gate row ``z_t`` (one
value per channel). Entry w of a compressor with ratio m pools the m tokens of window w
(positions w·m .. w·m+m-1), with a learned per-offset bias B [m, ·], channel by channel:

    e_w = Σ_j softmax_j(z_{w·m+j} + B_j) ⊙ c_{w·m+j}

With ``overlap`` (CSA) the rows are twice as wide, [a | b]: entry w pools 2m slots, the ``a`` halves of
window w-1 then the ``b`` halves of window w (width 2m, stride m); window -1 does not exist, so entry 0's
first m slots get weight 0. The softmax is fp32.

Attention (``compressed_attention``). One shared K=V head: the keys are the window rows (positions
``kv_start ..``; query t reads those with ``q_pos[t] - window < s <= q_pos[t]``) followed by the compressed
entries query t may read (``entry_mask`` [Tq, C]), with per-head sink logits in the denominator.
"""
from __future__ import annotations

import torch

from dayzero.ops.attention.reference import attention, sink_softmax
from dayzero.ops.registry import register


@register("compress_pool")
def compress_pool(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, overlap: bool = False,
                  prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Pool n whole windows; returns [n, d] in kv's dtype (d = W, or W/2 with ``overlap``).

    kv, gate: [n·m, W] rows of windows w0 .. w0+n-1; bias: [m, W]; with ``overlap``, ``prev_kv`` /
    ``prev_gate`` [m, W] are window w0-1's rows (None when w0 = 0)."""
    m, W = bias.shape
    N = kv.shape[0]
    if N % m or gate.shape != kv.shape or kv.shape[-1] != W:
        raise ValueError(f"compress_pool: kv {tuple(kv.shape)} / gate {tuple(gate.shape)} must be [n*{m}, {W}]")
    n = N // m
    c = kv.float().view(n, m, W)
    z = gate.float().view(n, m, W) + bias.float()
    if overlap:
        d = W // 2
        if prev_kv is None:  # window -1: zero rows with -inf gates
            prev_c, prev_z = c.new_zeros(1, m, W), c.new_full((1, m, W), float("-inf"))
        else:
            prev_c, prev_z = prev_kv.float()[None], prev_gate.float()[None] + bias.float()
        # slots 0..m-1: the a halves of the previous window; slots m..2m-1: the b halves of this one
        c = torch.cat((torch.cat((prev_c, c[:-1]))[..., :d], c[..., d:]), dim=1)  # [n, 2m, d]
        z = torch.cat((torch.cat((prev_z, z[:-1]))[..., :d], z[..., d:]), dim=1)
    return (z.softmax(dim=1) * c).sum(dim=1).to(kv.dtype)


@register("compressed_attention")
def compressed_attention(q: torch.Tensor, kv: torch.Tensor, kv_start: int, entries: torch.Tensor,
                         entry_mask: torch.Tensor, q_pos: torch.Tensor, scale: float, sinks: torch.Tensor | None,
                         window: int) -> torch.Tensor:
    """q: [Tq, H, D]; kv: [L, D] window rows of positions kv_start..; entries: [C, D]; entry_mask: [Tq, C]
    bool; returns [Tq, H, D] in q's dtype."""
    L, C = kv.shape[0], entries.shape[0]
    s = kv_start + torch.arange(L, device=kv.device)
    pos = q_pos[:, None]
    mask = torch.cat(((s <= pos) & (s > pos - window), entry_mask), dim=1)  # [Tq, L + C]
    keys = torch.cat((kv, entries.to(kv.dtype)))[:, None, :]  # [L + C, 1, D]
    # every key is admitted by the mask, none by position: all queries sit "after" the last key
    last = torch.full_like(q_pos, L + C - 1)
    return attention(q, keys, keys, last, scale, mask, sinks)


@register("compressed_attention_rows")
def compressed_attention_rows(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float,
                              sinks: torch.Tensor | None) -> torch.Tensor:
    """One query per sequence, all sequences at once (decode): q [B, H, D]; keys [B, L, D] (K=V: each sequence's
    window rows and entries, padded); mask [B, L] bool, the keys each query reads; returns [B, H, D] in q's dtype.
    Per row it is ``compressed_attention`` of that sequence's one query."""
    kf = keys.float().masked_fill(~mask[:, :, None], 0.0)  # keys not read may be stale rows (inf/NaN)
    s = torch.einsum("bhd,bld->bhl", q.float(), kf) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p, denom = sink_softmax(s, None if sinks is None else sinks.float().view(1, -1, 1))
    return (torch.einsum("bhl,bld->bhd", p, kf) / denom).to(q.dtype)


@register("compress_rows")
def compress_rows(kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, overlap: bool = False,
                  prev_kv: torch.Tensor | None = None, prev_gate: torch.Tensor | None = None,
                  has_prev: torch.Tensor | None = None) -> torch.Tensor:
    """One window per row (decode: each sequence's newest window), the same pooling as :func:`compress_pool`.
    kv, gate: [B, m, W]; bias: [m, W]; with ``overlap``, prev_kv / prev_gate [B, m, W] are each row's previous
    window and ``has_prev`` [B] says whether it exists (window 0 has none). Returns [B, d] in kv's dtype."""
    c = kv.float()
    z = gate.float() + bias.float()
    if overlap:
        d = kv.shape[-1] // 2
        pz = prev_gate.float() + bias.float()
        pz = pz.masked_fill(~has_prev[:, None, None], float("-inf"))  # no window -1: zero weight
        c = torch.cat((prev_kv.float()[..., :d], c[..., d:]), dim=1)  # [B, 2m, d]
        z = torch.cat((pz[..., :d], z[..., d:]), dim=1)
    return (z.softmax(dim=1) * c).sum(dim=1).to(kv.dtype)


def ring_read(ring: torch.Tensor, slot, lo: int, hi: int) -> torch.Tensor:
    """Rows of positions lo .. hi-1 from a sequence's ring [slots, R, ...] (all within its last R positions)."""
    return ring[slot, torch.arange(lo, hi, device=ring.device) % ring.shape[1]]


def ring_write(ring: torch.Tensor, slot, start: int, rows: torch.Tensor) -> None:
    """Keep the newest R of ``rows`` (positions start, start+1, ..) in the sequence's ring."""
    R, n = ring.shape[1], rows.shape[0]
    keep = torch.arange(max(start, start + n - R), start + n, device=ring.device)
    ring[slot, keep % R] = rows[keep - start].to(ring.dtype)


# --- batch-wide forms: one call per layer over the step ------------------------------------------------------
@register("compress_windows")
def compress_windows(raw: torch.Tensor, gate: torch.Tensor, raw_ring: torch.Tensor, gate_ring: torch.Tensor,
                     bias: torch.Tensor, overlap: bool, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool every window the step completes, for every sequence. raw, gate: [T, W] this step's rows; the rings
    [slots, R, W] (R = m, or 2m with overlap) hold each sequence's last R rows and are refreshed in place.
    Returns (pooled [N, d], window index w [N], entry slot [N]) of the N completed windows; the caller
    normalises and rotates them (at position w·m) and writes them at the slots."""
    m = bias.shape[0]
    pooled, entries, slots = [], [], []
    for b in range(batch.num_seqs):
        rows, slot = batch.rows(b), batch.state_slots[b]
        s, e = batch.seq_start[b], batch.seq_lens[b]
        w0, w1 = s // m, e // m  # entries w0 .. w1-1 complete in this step
        if w1 > w0:
            lo = max(0, (w0 - int(overlap)) * m)  # first position pooled (the previous window, with overlap)
            kv = torch.cat((ring_read(raw_ring, slot, lo, s), raw[rows][: w1 * m - s]))  # positions lo .. w1*m-1
            gt = torch.cat((ring_read(gate_ring, slot, lo, s), gate[rows][: w1 * m - s]))
            prev = w0 * m - lo  # rows of window w0-1 (m, or 0 for the first window)
            pooled.append(compress_pool(kv[prev:], gt[prev:], bias, overlap, kv[:prev] if prev else None,
                                        gt[:prev] if prev else None))
            w = torch.arange(w0, w1, device=raw.device)
            entries.append(w)
            slots.append(batch.entry_slots(b, m, w))
        ring_write(raw_ring, slot, s, raw[rows])
        ring_write(gate_ring, slot, s, gate[rows])
    if not pooled:
        empty = torch.zeros(0, dtype=torch.int64, device=raw.device)
        return raw.new_zeros(0, raw.shape[1] // (2 if overlap else 1)), empty, empty
    return torch.cat(pooled), torch.cat(entries), torch.cat(slots)


@register("compressed_indexer_topk")
def compressed_indexer_topk(q: torch.Tensor, weights: torch.Tensor, index_cache, ratio: int, batch,
                            topk: int) -> torch.Tensor:
    """CSA's selection for the whole step: per query row, the top-k of its sequence's complete compressed index
    keys it may read (entry w once (position + 1) // ratio > w). Returns [T, topk] entry indices, -1 padded."""
    from dayzero.cache.rows import read_rows
    from dayzero.ops.indexer.reference import indexer_topk

    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64, device=q.device)
    for b in range(batch.num_seqs):
        rows, count = batch.rows(b), batch.seq_lens[b] // ratio
        keys = read_rows(index_cache, batch.entry_slots(b, ratio, torch.arange(count, device=q.device)))
        ready = (batch.positions[rows] + 1) // ratio
        out[rows] = indexer_topk(q[rows], weights[rows], keys, ready - 1, topk)
    return out


@register("compressed_paged_attention")
def compressed_paged_attention(q: torch.Tensor, kv: torch.Tensor, kv_ring: torch.Tensor, entry_cache, selection,
                               ratio: int, batch, scale: float, sinks: torch.Tensor | None, window: int) -> torch.Tensor:
    """DeepSeek-V4 attention for the whole step: each sequence's queries over its window ring and this step's
    K=V rows (which join the ring, in place), plus its compressed entries (``entry_cache``, one row per
    ``ratio`` tokens; None for sliding-window layers): all causal ones, or the CSA ``selection`` [T, topk].
    q: [T, H, D]; kv: [T, D]; kv_ring: [slots, window, D]. Returns [T, H, D]."""
    from dayzero.cache.rows import read_rows
    from dayzero.ops.attention.reference import indices_to_mask

    out = torch.empty_like(q)
    for b in range(batch.num_seqs):
        rows, slot, start = batch.rows(b), batch.state_slots[b], batch.seq_start[b]
        q_pos = batch.positions[rows]
        lo = max(0, start - window + 1)  # the first key any query of this step can see
        keys = torch.cat((ring_read(kv_ring, slot, lo, start), kv[rows]))  # positions lo .. seq_lens[b]-1
        ring_write(kv_ring, slot, start, kv[rows])
        entries, mask = kv.new_zeros(0, kv.shape[1]), torch.zeros(q_pos.shape[0], 0, dtype=torch.bool, device=kv.device)
        if entry_cache is not None:
            count = batch.seq_lens[b] // ratio
            entries = read_rows(entry_cache, batch.entry_slots(b, ratio, torch.arange(count, device=kv.device)))
            if selection is None:
                mask = torch.arange(count, device=kv.device) < ((q_pos + 1) // ratio)[:, None]
            else:
                mask = indices_to_mask(selection[rows], count)
        out[rows] = compressed_attention(q[rows], keys, lo, entries, mask, q_pos, scale, sinks, window)
    return out
