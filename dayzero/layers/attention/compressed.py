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

Under tensor parallelism a rank holds H/tp query heads (``q_b_proj`` rows, ``sinks``) and the o_groups/tp output
groups they form (``o_a_proj`` rows by group, ``o_b_proj`` row-parallel: one all-reduce); the one K=V head,
``q_a_proj``, the compressors and their caches are whole on every rank. The CSA indexer's heads are split the
same way; their queries and weights are all-gathered ([T, Hi, Di] and [T, Hi] per layer) so that every rank
scores every head and selects the same entries.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec, StateSpec
from dayzero.config.spec import CompressedAttnSpec, RopeSpec
from dayzero.distributed import SINGLE, ParallelState, divide, tp_all_gather
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import Linear, Shard, column_linear, row_linear
from dayzero.layers.rotary import RotaryEmbedding
from dayzero.layers.fp8_linear import dense_weight


class Compressor(nn.Module):
    """One compressed series: per-token rows and gates, pooled per window into entries of width ``dim``."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, rope: RopeSpec, eps: float, name: str):
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.dim, self.ratio, self.overlap, self.name = dim, ratio, overlap, name
        self.ring = ratio * (2 if overlap else 1)  # raw rows kept per sequence
        self.kv_proj = Linear(hidden, width, bias=False)
        self.gate_proj = Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, eps)
        self.rotary = RotaryEmbedding(rope)

    def add_cache(self, rows: dict, strides: dict, state: dict, dtype) -> None:
        """Declare this series' cache: its entries (one row per ``ratio`` tokens) and its rings of raw rows."""
        rows[self.name], strides[self.name] = ((self.dim,), dtype), self.ratio
        ring = ((self.ring, self.kv_proj.out_features), dtype)
        state[f"{self.name}_raw"] = state[f"{self.name}_gate"] = ring

    def forward(self, layer: CachedLayer, x: torch.Tensor, batch) -> None:
        """Pool every window completed in this step and write its entry (``compress_windows`` reads and refreshes
        the rings in place)."""
        raw, gate = self.kv_proj(x), self.gate_proj(x)  # [T, width]
        pooled, w, slots = ops.call("compress_windows", raw, gate, layer.cache[f"{self.name}_raw"],
                                    layer.cache[f"{self.name}_gate"], self.position_bias, self.overlap, batch)
        cos, sin = self.rotary.cos_sin(w * self.ratio)  # each entry rotated at its window's first position
        layer.write_rows(self.name, slots, self.rotary(self.kv_norm(pooled)[:, None], cos, sin)[:, 0])


class CompressedIndexer(nn.Module):
    """CSA's lightning indexer over compressed keys: ``I[t, w] = Σ_h w_{t,h} ReLU(q_{t,h} · k_w)``."""

    def __init__(self, hidden: int, spec: CompressedAttnSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        ispec = spec.indexer
        self.parallel = parallel
        self.H = divide(ispec.n_heads, parallel, "index_n_heads")  # the rank's heads
        self.Dh, self.topk = ispec.head_dim, ispec.topk
        self.compressor = Compressor(hidden, self.Dh, spec.compress_ratio, spec.overlap, spec.compress_rope,
                                     spec.norm_eps, "index_k")
        self.q_b_proj = column_linear(spec.q_lora_rank, ispec.n_heads * self.Dh, False, parallel, what="index_n_heads")
        self.weights_proj = column_linear(hidden, ispec.n_heads, False, parallel, what="index_n_heads").float()
        self.rotary = RotaryEmbedding(spec.compress_rope)
        self.weight_scale = ispec.n_heads**-0.5 * self.Dh**-0.5

    def project(self, x: torch.Tensor, c_q: torch.Tensor, positions: torch.Tensor):
        """Every head's queries [T, Hi, Di] and weights [T, Hi] (the ranks' heads gathered under tp)."""
        cos, sin = self.rotary.cos_sin(positions)
        q = self.rotary(self.q_b_proj(c_q).view(x.shape[0], self.H, self.Dh), cos, sin)  # [T, Hi/tp, Di]
        w = torch.nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, Hi/tp]
        return tp_all_gather(q, self.parallel, dim=1), tp_all_gather(w, self.parallel, dim=1)


class CompressedAttention(CachedLayer):
    def __init__(self, hidden: int, spec: CompressedAttnSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self.spec = spec
        H, D, eps = spec.num_heads, spec.head_dim, spec.norm_eps
        if (H * D) % spec.o_groups:
            raise ValueError(f"{H} heads of {D} cannot be split into o_groups={spec.o_groups} equal groups")
        self.groups = divide(spec.o_groups, parallel, "o_groups")  # the rank's output groups and their heads
        self.H, self.D, self.eps = H // parallel.tp_size, D, eps
        self.q_a_proj = Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(spec.q_lora_rank, eps)
        self.q_b_proj = column_linear(spec.q_lora_rank, H * D, False, parallel, what="num_attention_heads")
        self.kv_proj = Linear(hidden, D, bias=False)
        self.kv_norm = RMSNorm(D, eps)
        self.o_a_proj = column_linear(H * D // spec.o_groups, spec.o_groups * spec.o_lora_rank, False, parallel,
                                      what="o_groups")
        self.o_b_proj = row_linear(spec.o_groups * spec.o_lora_rank, hidden, False, parallel, what="o_groups")
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32))
        if parallel.tp_size > 1:
            self.shards = {"sinks": Shard(0, parallel.tp_rank, parallel.tp_size)}
        self.rotary = RotaryEmbedding(spec.rope)
        self.compressor = self.indexer = None
        if spec.compress_ratio:
            self.compressor = Compressor(hidden, D, spec.compress_ratio, spec.overlap, spec.compress_rope, eps, "ckv")
            if spec.indexer is not None:
                self.indexer = CompressedIndexer(hidden, spec, parallel)
        self.scale = D**-0.5

    def process_weights_after_loading(self) -> None:
        self.o_a_weight()  # a block-FP8 o_a_proj is dequantised here, once, not in a step

    def o_a_weight(self) -> torch.Tensor:
        """o_a_proj's weight dense (the grouped output einsum reads it), in the model dtype."""
        return dense_weight(self.o_a_proj, self.kv_norm.weight.dtype)

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
        cos, sin = self.rotary.step_cos_sin(batch)
        q = self.rotary(q, cos, sin)
        kv = self.rotary(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]  # [T, D]
        if self.compressor is not None:
            self.compressor(self, x, batch)
        iq = iw = None
        if self.indexer is not None:
            self.indexer.compressor(self, x, batch)
            iq, iw = self.indexer.project(x, c_q, batch.positions)

        entries = selection = None
        if self.compressor is not None:
            entries = self.cache[self.compressor.name]
            if self.indexer is not None:
                selection = ops.call("compressed_indexer_topk", iq, iw, self.cache[self.indexer.compressor.name],
                                     self.spec.compress_ratio, batch, self.indexer.topk)  # [T, topk] entry indices
        out = ops.call("compressed_paged_attention", q, kv, self.cache["kv"], entries, selection, self.spec.compress_ratio,
                       batch, self.scale, self.sinks, self.spec.sliding_window)  # [T, H, D]
        out = self.rotary(out, cos, -sin)  # the values carried RoPE: rotate the output back to the query's frame
        g = self.groups  # the rank's
        w_a = self.o_a_weight().view(g, self.spec.o_lora_rank, -1)  # [g, r, H*D/g]
        low = torch.einsum("tgi,gri->tgr", out.reshape(T, g, -1), w_a)  # [T, g, r]
        return self.o_b_proj(low.reshape(T, -1))
