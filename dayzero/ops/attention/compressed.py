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
    kf = keys.float()
    s = torch.einsum("bhd,bld->bhl", q.float(), kf) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    p, denom = sink_softmax(s, None if sinks is None else sinks.float().view(1, -1, 1))
    return (torch.einsum("bhl,bld->bhd", p, kf) / denom).to(q.dtype)
