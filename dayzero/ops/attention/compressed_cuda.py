"""DeepSeek-V4 compressed attention's decode steps on the device, every sequence at once with fixed shapes
(no host length is read, so they run inside captured CUDA graphs; prefill chunks are refused and the
per-sequence references run them):

- ``compress_windows``: each row's raw row and gate join its rings, every row pools its newest window from
  the ring, and rows whose window is not complete write their entry to the null slot 0.
- ``compressed_indexer_topk`` / ``compressed_paged_attention``: the complete entries of every sequence are
  gathered as a [B, key_width // ratio] tile through the block tables, masked by (position + 1) // ratio.
"""
from __future__ import annotations

import torch

from dayzero.cache.rows import read_rows, slots_of
from dayzero.ops.attention.compressed import compress_rows, compressed_attention_rows
from dayzero.ops.attention.cuda import _decode_only
from dayzero.ops.attention.reference import indices_to_mask
from dayzero.ops.indexer.reference import indexer_topk_rows
from dayzero.ops.registry import register


def _entries(batch, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decode row's entry indices [B, C] (C = key_width // ratio) and which are complete and causal."""
    w = torch.arange(batch.key_width // ratio, device=batch.positions.device).expand(batch.positions.shape[0], -1)
    return w, w < ((batch.positions + 1) // ratio)[:, None]


@register("compress_windows", "cuda", verifier=lambda raw, gate, rr, gr, bias, ov, batch: _decode_only(batch),
          note="every decode row pools its newest window from its ring (PyTorch)")
def compress_windows_decode(raw, gate, raw_ring, gate_ring, bias, overlap: bool, batch):
    # raw, gate: [B, W]; rings: [slots, R, W]; bias: [m, W] -> pooled [B, d], w [B], slot [B] (0 if incomplete)
    m, R = bias.shape[0], raw_ring.shape[1]
    pos, slots = batch.positions, batch.state_slots
    raw_ring[slots, pos % R] = raw.to(raw_ring.dtype)
    gate_ring[slots, pos % R] = gate.to(gate_ring.dtype)
    rp = pos[:, None] - R + 1 + torch.arange(R, device=pos.device)  # ring positions, oldest first: [B, R]
    kv, gt = raw_ring[slots[:, None], rp % R], gate_ring[slots[:, None], rp % R]  # [B, R, W]
    prev = (kv[:, :m], gt[:, :m], rp[:, 0] >= 0) if overlap else (None, None, None)
    pooled = compress_rows(kv[:, R - m:], gt[:, R - m:], bias, overlap, *prev)
    w = (pos + 1) // m - 1
    complete = (pos + 1) % m == 0
    entry = slots_of(batch.block_tables, w.clamp(min=0)[:, None], batch.block_size, m)[:, 0]
    return pooled, w.clamp(min=0), torch.where(complete, entry, 0)


@register("compressed_indexer_topk", "cuda", verifier=lambda q, w, ic, r, batch, k: _decode_only(batch),
          note="decode rows scored against every sequence's entries at once (PyTorch)")
def compressed_indexer_topk_decode(q, weights, index_cache, ratio: int, batch, topk: int) -> torch.Tensor:
    w, valid = _entries(batch, ratio)
    keys = read_rows(index_cache, slots_of(batch.block_tables, w, batch.block_size, ratio))  # [B, C, Di]
    return indexer_topk_rows(q, weights, keys, valid, topk)


@register("compressed_paged_attention", "cuda",
          verifier=lambda q, kv, ring, ec, sel, r, batch, *a, **k: _decode_only(batch),
          note="decode rows over their window rings and entries at once (PyTorch)")
def compressed_paged_attention_decode(q, kv, kv_ring, entry_cache, selection, ratio: int, batch, scale: float,
                                      sinks, window: int) -> torch.Tensor:
    # q: [B, H, D]; kv: [B, D]; kv_ring: [slots, window, D]
    pos, slots = batch.positions, batch.state_slots
    kv_ring[slots, pos % window] = kv.to(kv_ring.dtype)
    keys = kv_ring[slots]  # [B, window, D]: positions pos - ((pos - r) mod window), those < 0 never written
    r = torch.arange(window, device=kv.device)
    mask = pos[:, None] - (pos[:, None] - r) % window >= 0
    if entry_cache is not None:
        w, valid = _entries(batch, ratio)
        entries = read_rows(entry_cache, slots_of(batch.block_tables, w, batch.block_size, ratio))  # [B, C, D]
        if selection is not None:
            valid = indices_to_mask(selection, w.shape[1])
        keys, mask = torch.cat((keys, entries.to(keys.dtype)), dim=1), torch.cat((mask, valid), dim=1)
    return compressed_attention_rows(q, keys, mask, scale, sinks)
