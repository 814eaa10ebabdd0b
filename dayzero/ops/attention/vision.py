"""Bidirectional attention over the packed patch rows of several images (vision towers).

Rows of all images are concatenated; ``cu_seqlens`` ([S+1], starting at 0 and ending at N; best on the host,
where the towers keep it: a device copy is read back at every call) cuts them
into S segments (one per image, or per frame), and a row attends to every row of its own segment and to
no other. There is no mask, no causality and no cache: each segment is one dense softmax attention.

The reference runs segment by segment with fp32 scores, softmax and weighted sum, in query blocks so the
[H, rows, keys] score matrix stays bounded for large images. The cuda implementation runs each segment
through torch SDPA (flash or memory-efficient kernels, no mask materialised).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.attention.reference import q_block_rows
from dayzero.ops.registry import register


def segment_bounds(cu_seqlens: torch.Tensor, rows: int) -> list[tuple[int, int]]:
    """``cu_seqlens`` checked against ``rows`` and read once to the host: [(start, end)] per non-empty segment."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != rows or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens {cu} must rise from 0 to the {rows} packed rows")
    return [(a, b) for a, b in zip(cu, cu[1:]) if b > a]


@register("vision_attention")
def vision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     *, q_block: int | None = None) -> torch.Tensor:
    # q, k, v: [N, H, D]; cu_seqlens: [S+1] int; returns [N, H, D] in q's dtype
    N, H, D = q.shape
    assert k.shape == q.shape and v.shape[:2] == q.shape[:2], \
        f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    out = torch.empty(N, H, v.shape[-1], dtype=q.dtype, device=q.device)
    for a, b in segment_bounds(cu_seqlens, N):
        # kf: [H, L, D], vf: [H, L, Dv] fp32, so scores and the weighted sum are fp32
        kf = k[a:b].float().transpose(0, 1)
        vf = v[a:b].float().transpose(0, 1)
        rows = q_block_rows(H, b - a, q_block)
        for t0 in range(a, b, rows):
            t1 = min(b, t0 + rows)
            qb = q[t0:t1].float().transpose(0, 1)  # [H, B, D]
            p = torch.softmax(torch.matmul(qb, kf.transpose(1, 2)) * scale, dim=-1)  # [H, B, L]
            out[t0:t1] = torch.matmul(p, vf).transpose(0, 1).to(q.dtype)
    return out


SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _sdpa_verify(q, k, v, cu_seqlens, scale, **kwargs) -> str | None:
    if q.device.type != "cuda":
        return f"q is on {q.device.type}, not cuda"
    if q.dtype not in SDPA_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q {q.dtype}, k {k.dtype}, v {v.dtype}: SDPA needs one of fp16/bf16/fp32 for all three"
    if k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        return f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match"
    return None


@register("vision_attention", "cuda", verifier=_sdpa_verify,
          note="torch SDPA per segment (flash / memory-efficient kernels; no block-diagonal mask)")
def vision_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                          scale: float, **kwargs) -> torch.Tensor:
    # q, k, v: [N, H, D] -> [N, H, Dv]
    N, H, _ = q.shape
    out = torch.empty(N, H, v.shape[-1], dtype=q.dtype, device=q.device)
    for a, b in segment_bounds(cu_seqlens, N):
        # SDPA wants [B, H, L, D]: one segment is one batch row
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, scale=scale)  # [1, H, L, Dv]
        out[a:b] = o[0].transpose(0, 1)
    return out
