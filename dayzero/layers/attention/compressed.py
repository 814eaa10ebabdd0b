"""DeepSeek-V4 attention (the DeepSeek-V4 paper, section 2.3; transformers' ``deepseek_v4`` is the parity
reference): shared-KV multi-query attention over a sliding window, plus compressed entries (HCA: all of
them; CSA: the indexer's top-k).

Per token x (the layer's normalised input), with every RoPE interleaved on the LAST ``rope.dim`` channels:

    c_q = RMSNorm(q_a x);  q = RoPE(RMSNorm_noweight(q_b c_q per head))     # [H, D]
    kv  = RoPE(RMSNorm(kv_proj x))                                         # [D], key and value at once
    o_h = softmax-with-sink(q_h · [window kv ‖ entries] · D^-1/2) · [window kv ‖ entries]
    o_h = RoPE^-1(o_h) at the query's position                            # undo the values' rotation
    out = o_b(concat_g o_a,g(heads of group g))                           # grouped low-rank output

A compressor (ratio m) projects every token to a row and a gate (``ops/attention/compressed``) and emits
one entry per m tokens: pooled, RMSNorm'd, rotated (compress RoPE) at the window's first position. Query
at position p may read entry w when w < (p+1) // m (the window is complete). CSA's lightning indexer has
its own compressor (index_head_dim wide) and scores the entries with ``indexer_topk``, whose causal rule
(key index <= position) reads entries once positions are mapped to (p+1) // m - 1.

Cache: the entries (paged, one row per m tokens: ``PagedSpec.strides``) and, per sequence, rings indexed
by position mod their length: the K=V rows of the last ``sliding_window`` tokens (no older row is ever read
again, so a 1M-token sequence keeps 128 of them, not 1M), and the raw rows and gates of the last m tokens
(2m with overlap), from which the next entries are pooled once their window completes.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec, StateSpec
from dayzero.config.spec import CompressedAttnSpec, RopeSpec
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.norm import RMSNorm
from dayzero.layers.rotary import RotaryEmbedding
from dayzero.ops.attention.reference import indices_to_mask
from dayzero.quant.fp8 import dense_weight


def ring_read(ring: torch.Tensor, slot, lo: int, hi: int) -> torch.Tensor:
    """Rows of positions lo .. hi-1 from a sequence's ring [slots, R, ...] (all within its last R positions)."""
    return ring[slot, torch.arange(lo, hi, device=ring.device) % ring.shape[1]]


def ring_write(ring: torch.Tensor, slot, start: int, rows: torch.Tensor) -> None:
    """Keep the newest R of ``rows`` (positions start, start+1, ..) in the sequence's ring."""
    R, n = ring.shape[1], rows.shape[0]
    keep = torch.arange(max(start, start + n - R), start + n, device=ring.device)
    ring[slot, keep % R] = rows[keep - start].to(ring.dtype)


class Compressor(nn.Module):
    """One compressed series: per-token rows and gates, pooled per window into entries of width ``dim``."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, rope: RopeSpec, eps: float, name: str):
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.ratio, self.overlap, self.name = dim, ratio, overlap, name
        self.ring = ratio * (2 if overlap else 1)  # raw rows kept per sequence
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.rotary = RotaryEmbedding(rope)

    def add_cache(self, rows: dict, strides: dict, state: dict, dtype) -> None:
        """Declare this series' cache: its entries (one row per ``ratio`` tokens) and its rings of raw rows."""
        rows[self.name], strides[self.name] = ((self.dim,), dtype), self.ratio
        ring = ((self.ring, self.kv_proj.out_features), dtype)
        state[f"{self.name}_raw"] = state[f"{self.name}_gate"] = ring

    def forward(self, layer: CachedLayer, x: torch.Tensor, batch) -> None:
        """Pool every window completed in this step and write its entry (reads and refreshes the ring)."""
        m = self.ratio
        raw, gate = self.kv_proj(x), self.gate_proj(x)  # [T, width]
        raw_ring, gate_ring = layer.cache[f"{self.name}_raw"], layer.cache[f"{self.name}_gate"]
        decode = batch.max_query_len == 1
        if decode:  # one token per sequence: every ring takes its row at once; only completed windows loop below
            at = batch.positions % self.ring
            raw_ring[batch.state_slots, at] = raw.to(raw_ring.dtype)
            gate_ring[batch.state_slots, at] = gate.to(gate_ring.dtype)
        for b in range(batch.num_seqs):
            rows, slot = batch.rows(b), batch.state_slots[b]
            s, e = batch.seq_start[b], batch.seq_lens[b]
            w0, w1 = s // m, e // m  # entries w0 .. w1-1 complete in this step
            if w1 > w0:
                lo = max(0, (w0 - int(self.overlap)) * m)  # first position pooled (the previous window, with overlap)
                kv = torch.cat((ring_read(raw_ring, slot, lo, s), raw[rows][: w1 * m - s]))  # positions lo .. w1*m-1
                gt = torch.cat((ring_read(gate_ring, slot, lo, s), gate[rows][: w1 * m - s]))
                prev = w0 * m - lo  # rows of window w0-1 (m, or 0 for the first window)
                pooled = ops.call("compress_pool", kv[prev:], gt[prev:], self.position_bias, self.overlap,
                                  kv[:prev] if prev else None, gt[:prev] if prev else None)
                entries = torch.arange(w0, w1, device=x.device)
                cos, sin = self.rotary.cos_sin(entries * m)
                pooled = self.rotary(self.kv_norm(pooled)[:, None], cos, sin)[:, 0]
                layer.write_rows(self.name, batch.entry_slots(b, m, entries), pooled)
            if not decode:
                ring_write(raw_ring, slot, s, raw[rows])
                ring_write(gate_ring, slot, s, gate[rows])

    def read(self, layer: CachedLayer, batch, b: int) -> torch.Tensor:
        """Every complete entry of sequence b, [C, dim]."""
        count = batch.seq_lens[b] // self.ratio
        return layer.read_rows(self.name, batch.entry_slots(b, self.ratio, torch.arange(count, device=batch.block_tables.device)))

    def read_all(self, layer: CachedLayer, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sequence's complete entries, padded: ([B, C, dim], valid [B, C]) with C the most any sequence has."""
        counts = [e // self.ratio for e in batch.seq_lens]
        dev = batch.block_tables.device
        w = torch.arange(max(counts, default=0), device=dev)
        slots = batch.entry_slots(slice(None), self.ratio, w)  # [B, C]
        rows = layer.read_rows(self.name, slots.reshape(-1)).view(*slots.shape, self.dim)
        return rows, w < torch.tensor(counts, device=dev)[:, None]


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer over compressed keys: ``I[t, w] = Σ_h w_{t,h} ReLU(q_{t,h} · k_w)``."""

    def __init__(self, hidden: int, spec: CompressedAttnSpec):
        super().__init__()
        ispec = spec.indexer
        self.H, self.Dh, self.topk = ispec.n_heads, ispec.head_dim, ispec.topk
        self.compressor = Compressor(hidden, self.Dh, spec.compress_ratio, spec.overlap, spec.compress_rope,
                                     spec.norm_eps, "index_k")
        self.q_b_proj = nn.Linear(spec.q_lora_rank, self.H * self.Dh, bias=False)
        self.weights_proj = nn.Linear(hidden, self.H, bias=False, dtype=torch.float32)
        self.rotary = RotaryEmbedding(spec.compress_rope)
        self.weight_scale = self.H**-0.5 * self.Dh**-0.5

    def project(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor):
        cos, sin = self.rotary.cos_sin(positions)
        q = self.rotary(self.q_b_proj(c_q).view(x.shape[0], self.H, self.Dh), cos, sin)  # [T, Hi, Di]
        w = torch.nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi]
        return q, w


class CompressedAttention(CachedLayer):
    def __init__(self, hidden: int, spec: CompressedAttnSpec):
        super().__init__()
        self.spec = spec
        H, D, eps = spec.num_heads, spec.head_dim, spec.norm_eps
        if (H * D) % spec.o_groups:
            raise ValueError(f"{H} heads of {D} cannot be split into o_groups={spec.o_groups} equal groups")
        self.H, self.D, self.eps = H, D, eps
        self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(spec.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(spec.q_lora_rank, H * D, bias=False)
        self.kv_proj = nn.Linear(hidden, D, bias=False)
        self.kv_norm = RMSNorm(D, eps)
        self.o_a_proj = nn.Linear(H * D // spec.o_groups, spec.o_groups * spec.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(spec.o_groups * spec.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.rotary = RotaryEmbedding(spec.rope)
        self.compressor = self.indexer = None
        if spec.compress_ratio:
            self.compressor = Compressor(hidden, D, spec.compress_ratio, spec.overlap, spec.compress_rope, eps, "ckv")
            if spec.indexer is not None:
                self.indexer = CompressedIndexer(hidden, spec)
        self.scale = D**-0.5

    def cache_spec(self, dtype):
        state = {"kv": ((self.spec.sliding_window, self.D), dtype)}  # the window's K=V ring
        if self.compressor is None:
            return StateSpec(state)
        rows, strides = {}, {}
        for c in (self.compressor, *([self.indexer.compressor] if self.indexer is not None else [])):
            c.add_cache(rows, strides, state, dtype)
        return PagedSpec(rows, strides=strides), StateSpec(state)

    def forward(self, x: torch.Tensor, batch) -> torch.Tensor:
        T, H, D = x.shape[0], self.H, self.D
        c_q = self.q_a_norm(self.q_a_proj(x))
        q, _ = ops.call("rms_norm", self.q_b_proj(c_q).view(T, H, D), None, self.eps)  # per head, no weight
        cos, sin = self.rotary.cos_sin(batch.positions)
        q = self.rotary(q, cos, sin)
        kv = self.rotary(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]  # [T, D]
        if self.compressor is not None:
            self.compressor(self, x, batch)
        iq = iw = None
        if self.indexer is not None:
            self.indexer.compressor(self, x, batch)
            iq, iw = self.indexer.project(x, c_q, batch.positions)

        attend = self._decode if batch.max_query_len == 1 else self._prefill
        out = attend(q, kv, batch, iq, iw)
        out = self.rotary(out, cos, -sin)  # the values carried RoPE: rotate the output back to the query's frame
        g = self.spec.o_groups
        w_a = dense_weight(self.o_a_proj, out.dtype).view(g, self.spec.o_lora_rank, -1)  # [g, r, H*D/g]
        low = torch.einsum("tgi,gri->tgr", out.reshape(T, g, -1), w_a)  # [T, g, r]
        return self.o_b_proj(low.reshape(T, -1))

    def _decode(self, q, kv, batch, iq, iw) -> torch.Tensor:
        """One token per sequence: every sequence at once over its window ring and its padded entries."""
        W, ring = self.spec.sliding_window, self.cache["kv"]
        pos, slots = batch.positions, batch.state_slots
        ring[slots, pos % W] = kv.to(ring.dtype)
        keys = ring[slots]  # [B, W, D]: positions pos - ((pos - r) mod W), those < 0 never written
        r = torch.arange(W, device=kv.device)
        mask = pos[:, None] - (pos[:, None] - r) % W >= 0
        if self.compressor is not None:
            entries, valid = self.compressor.read_all(self, batch)  # [B, C, D]: all complete entries may be read
            if self.indexer is not None:
                index_keys, _ = self.indexer.compressor.read_all(self, batch)
                idx = ops.call("indexer_topk_rows", iq, iw, index_keys, valid, self.indexer.topk)
                valid = indices_to_mask(idx, entries.shape[1])
            keys, mask = torch.cat((keys, entries.to(keys.dtype)), dim=1), torch.cat((mask, valid), dim=1)
        return ops.call("compressed_attention_rows", q, keys, mask, self.scale, self.sinks)

    def _prefill(self, q, kv, batch, iq, iw) -> torch.Tensor:
        """Chunks of queries, a sequence at a time, over the window ring + this chunk's rows and the entries."""
        out = torch.empty_like(q)
        window, m, D = self.spec.sliding_window, self.spec.compress_ratio, self.D
        for b in range(batch.num_seqs):
            rows, slot, start = batch.rows(b), batch.state_slots[b], batch.seq_start[b]
            q_pos = batch.positions[rows]
            lo = max(0, start - window + 1)  # the first key any query of this step can see
            keys = torch.cat((ring_read(self.cache["kv"], slot, lo, start), kv[rows]))  # positions lo .. seq_lens[b]-1
            ring_write(self.cache["kv"], slot, start, kv[rows])
            entries, mask = kv.new_zeros(0, D), torch.zeros(rows.stop - rows.start, 0, dtype=torch.bool, device=kv.device)
            if self.compressor is not None:
                entries = self.compressor.read(self, batch, b)  # [C, D]
                ready = (q_pos + 1) // m  # entries each query may read
                if self.indexer is None:
                    mask = torch.arange(entries.shape[0], device=kv.device) < ready[:, None]
                else:
                    index_keys = self.indexer.compressor.read(self, batch, b)
                    idx = ops.call("indexer_topk", iq[rows], iw[rows], index_keys, ready - 1, self.indexer.topk)
                    mask = indices_to_mask(idx, entries.shape[0])
            out[rows] = ops.call("compressed_attention", q[rows], keys, lo, entries, mask, q_pos, self.scale, self.sinks,
                                 window)
        return out
