"""MLA (ARCHITECTURE.md 2.1), and gated DSA: MLA + lightning indexer top-k (2.2) + sigmoid output gate (2.3).

Cache per token: the latent row ``[c (kv_lora_rank) ‖ k_pe (rope dim)]`` and, with an indexer, the indexer
key, both paged under the sequence's one block table. One ``paged_mla`` call attends for the whole step:
prefill chunks in the naive (MHA) form, single-token decode rows in the absorbed (MQA) form, which reads only
the latent rows. The indexer (``paged_indexer_topk``) writes every query row's top-k key positions into the
step's selection buffer. When the block tables address no more than ``topk`` keys (``batch.key_width``: a
shape of the step, fixed for a captured graph, never a sequence length) every sequence is that short, every
causal key would be selected, and the indexer is skipped (dense MLA). A graph captured at a small width is
only replayed for steps of that width, so the shortcut is never replayed at a longer context.

IndexCache (GLM-MoE-DSA ``indexer_types``, HY-V4): a layer whose indexer spec is ``shared`` has no indexer
and no indexer key cache; it attends over the keys chosen by the nearest earlier layer that ran its indexer
in the same step. That choice is the step's declared ``batch.selection``, so nothing outlives the step.

Options HY-V4 uses: a per-head learned sink logit in the softmax denominator (``sinks``), a head-wise output
gate (one sigmoid per head, ``g_proj`` [H, D]), and an indexer whose RoPE covers its LAST dims.

Under tensor parallelism a rank holds H/tp heads: ``q_b_proj`` (or ``q_proj``), ``kv_b_proj`` and ``g_proj`` are
column-parallel by head, ``o_proj`` row-parallel (one all-reduce of [T, D] per layer), the sinks cut by head;
the down-projections, their norms and the latent cache are whole on every rank (the latent row serves all
heads). The indexer's query heads are split the same way (``wq_b`` and ``weights_proj`` by head), its key
(one per token, shared by every head), ``k_norm`` and key cache whole: a key's score is a sum over heads, so a
rank scores the keys with its heads, one all-reduce of the [T, key width] fp32 scores sums them, and every rank
takes the same top-k of the same sums.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.cache.spec import PagedSpec
from dayzero.config.spec import IndexerSpec, MLASpec
from dayzero.distributed import SINGLE, ParallelState, divide, tp_all_reduce
from dayzero.layers.attention.base import CachedLayer
from dayzero.layers.fused import fuse, project
from dayzero.layers.norm import LayerNorm, RMSNorm
from dayzero.layers.parallel import PLAIN_LINEARS, Linear, Shard, column_linear, fused_product, row_linear
from dayzero.layers.rotary import RotaryEmbedding
from dayzero.ops.indexer.triton_indexer import chunk_rows
from dayzero.layers.fp8_linear import dense_weight
from dayzero.ops.static import mark_static


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_in: int, spec: IndexerSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        heads = "index_n_heads"
        self.H, self.Dh, self.topk = divide(spec.n_heads, parallel, heads), spec.head_dim, spec.topk  # the rank's heads
        self.parallel = parallel
        self.wq_b = column_linear(q_in, spec.n_heads * self.Dh, False, parallel, what=heads)
        self.wk = Linear(hidden, self.Dh, bias=False)  # the key, shared by every head: whole on every rank
        self.k_norm = LayerNorm(self.Dh, spec.norm_eps)
        # weights_proj stays in high precision (ARCHITECTURE.md 2.2)
        if parallel.tp_size == 1:
            self.weights_proj = nn.Linear(hidden, self.H, bias=False, dtype=torch.float32)
        else:
            self.weights_proj = column_linear(hidden, spec.n_heads, False, parallel, what=heads).float()
        self.weight_scale = spec.n_heads**-0.5 * self.Dh**-0.5  # of all heads, whatever the rank holds
        self.rotary = RotaryEmbedding(spec.rope)  # rotates the first rope.dim dims, or the last with rope.last

    def key_args(self, x, batch, pool, k=None) -> tuple:
        """``indexer_key_write``'s arguments before the slots: the key ``k`` (``wk(x)`` unless the caller computed
        it), its LayerNorm, the rotary of the step's positions and ``pool``."""
        cos, sin = self.rotary.step_cos_sin(batch)
        k = self.wk(x) if k is None else k  # [T, Di]
        return (k, self.k_norm.weight, self.k_norm.bias, self.k_norm.eps, cos, sin, self.rotary.interleaved,
                self.rotary.start(self.Dh), pool)

    def project(self, x, c_q, batch, pool, k=None, q=None, selects: bool = True, key_written: bool = False):
        """(q, weights) of the indexer at the step's positions, its key normed, rotated and written to ``pool`` at
        the step's slots (one op, unless ``key_written``: the caller wrote it with :meth:`key_args`); ``k``:
        ``wk(x)`` and ``q``: ``wq_b(c_q)`` when the caller computed them (in fused GEMMs). Without ``selects`` (a
        step whose block tables address no more than ``topk`` keys: every key is selected) only the key is
        written, and (None, None) returned."""
        T = x.shape[0]
        if not key_written:
            ops.call("indexer_key_write", *self.key_args(x, batch, pool, k), batch.slot_mapping)
        if not selects:
            return None, None
        cos, sin = self.rotary.step_cos_sin(batch)
        q = self.wq_b(c_q) if q is None else q
        q = self.rotary(q.view(T, self.H, self.Dh), cos, sin)  # [T, Hi, Di]
        scaled = getattr(self, "_scaled_weights", None)
        if scaled is not None:  # the scale folded into the weights: one GEMV
            w = ops.call("linear", x, scaled, out_dtype=torch.float32)  # [T, Hi]
        else:
            w = ops.call("linear", x, self.weights_proj.weight, out_dtype=torch.float32) * self.weight_scale
        return q, w

    def process_weights_after_loading(self) -> None:
        """The head weights times their scale, once (fp32, beside the parameter, which keeps the checkpoint's
        values): a decode step runs one GEMV where a GEMV and a multiply ran."""
        self._scaled_weights = mark_static(self.weights_proj.weight.detach() * self.weight_scale)

    def select(self, q: torch.Tensor, w: torch.Tensor, k_cache, batch) -> torch.Tensor:
        """Every query row's top-k key positions [T, topk] (-1 padded) in the step's selection buffer."""
        out = batch.topk_buffer(self.topk)
        if self.parallel.tp_size == 1:
            return ops.call("paged_indexer_topk", q, w, k_cache, batch, self.topk, out)
        # This rank's heads give partial scores; their sum over the tp group is every head's score, the same
        # tensor on every rank, so every rank selects the same keys (ties included). Rows go in chunks whose
        # scores and top-k outputs stay under the indexer's scratch budget (the prefill scratch the cache counts).
        T, W = q.shape[0], batch.key_width
        rows = chunk_rows(W, self.topk)
        scratch = torch.empty(min(T, rows), W, dtype=torch.float32, device=q.device)
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            scores = ops.call("paged_indexer_scores", q, w, k_cache, batch, scratch[:t1 - t0], t0)  # [rows, W]
            tp_all_reduce(scores, self.parallel)
            ops.call("indexer_topk_of_scores", scores, batch.positions[t0:t1], self.topk, out[t0:t1])
        return out


class MLAAttention(CachedLayer):
    takes_projected = True  # forward may be given fused_in(x), computed with the input norm

    def __init__(self, hidden: int, spec: MLASpec, eps: float = 1e-6, parallel: ParallelState = SINGLE):
        super().__init__()
        self.spec = spec
        H = spec.num_heads  # all heads; self.H is the rank's
        heads = "num_attention_heads"
        self.H = divide(H, parallel, heads)
        self.N, self.P = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.V, self.R = spec.v_head_dim, spec.kv_lora_rank
        if spec.q_lora_rank:
            self.q_a_proj = Linear(hidden, spec.q_lora_rank, bias=spec.bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, spec.latent_norm_eps or eps)
            self.q_b_proj = column_linear(spec.q_lora_rank, H * (self.N + self.P), False, parallel, what=heads)
        else:
            self.q_proj = column_linear(hidden, H * (self.N + self.P), False, parallel, what=heads)
        self.kv_a_proj_with_mqa = Linear(hidden, self.R + self.P, bias=spec.bias)
        self.kv_a_layernorm = RMSNorm(self.R, spec.latent_norm_eps or eps)
        self.kv_b_proj = column_linear(self.R, H * (self.N + self.V), False, parallel, what=heads)
        self.o_proj = row_linear(H * self.V, hidden, spec.bias, parallel, what=heads)
        if spec.output_gate_kind not in ("elementwise", "headwise"):
            raise ValueError(f"output_gate_kind {spec.output_gate_kind!r}: expected 'elementwise' or 'headwise'")
        self.gate_width = self.V if spec.output_gate_kind == "elementwise" else 1
        self.g_proj = None
        if spec.output_gate:
            self.g_proj = column_linear(hidden, H * self.gate_width, False, parallel, what=heads)
        # sink logits stay fp32, as the softmax they join
        self.sinks = nn.Parameter(torch.zeros(self.H, dtype=torch.float32)) if spec.sinks else None
        if parallel.tp_size > 1 and self.sinks is not None:
            self.shards = {"sinks": Shard(0, parallel.tp_rank, parallel.tp_size)}  # one sink per head
        ispec = spec.indexer
        own_indexer = ispec is not None and not ispec.shared
        self.indexer = Indexer(hidden, spec.q_lora_rank or hidden, ispec, parallel) if own_indexer else None
        self.shares_selection = ispec is not None and ispec.shared
        self.rotary = RotaryEmbedding(spec.rope) if spec.rope is not None else None
        self.scale = spec.scale
        # the projections of the layer's input, one GEMM once fused (dayzero.layers.fused); biases only on the first two
        self.in_proj_members = ["q_a_proj" if spec.q_lora_rank else "q_proj", "kv_a_proj_with_mqa"]
        # the projections of the normed query latent: the heads' queries and the indexer's
        self.q_members = ["q_b_proj"] + ["indexer.wq_b"] * (self.indexer is not None) if spec.q_lora_rank else []
        if not spec.bias:
            self.in_proj_members += ["indexer.wk"] * (self.indexer is not None) + ["g_proj"] * (self.g_proj is not None)

    @property
    def selection_width(self) -> int:
        """Columns of the step's selection buffer this layer's indexer writes (0: none)."""
        return self.indexer.topk if self.indexer is not None else 0

    def process_weights_after_loading(self) -> None:
        self.kv_b_weight()  # a block-FP8 kv_b is dequantised here, once, not in a step
        fuse(self, "fused_in", self.in_proj_members)
        fuse(self, "fused_q", self.q_members)

    def kv_b_weight(self) -> torch.Tensor:
        """kv_b_proj's weight [H*(N+V), R] dense, in the model dtype (that of the latent norm's weight)."""
        return dense_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype)

    def cache_spec(self, dtype):
        rows = {"latent": ((self.R + self.P,), dtype)}
        if self.indexer is not None:
            rows["index_k"] = ((self.indexer.Dh,), dtype)
        return PagedSpec(rows)

    def _write_latent(self, c_kv: torch.Tensor, k_pe: torch.Tensor, cos, sin, batch) -> None:
        """The step's latent cache rows ``[norm(c_kv) | rope(k_pe)]`` ([T, R] and [T, P]): one op where the
        rotary turns the whole rope key (one launch on a GPU), else the norm, rotary and write apart."""
        rot = self.rotary
        if rot is None or rot.dim == self.P:
            ops.call("mla_latent_write", c_kv, self.kv_a_layernorm.scale(), self.kv_a_layernorm.eps, k_pe, cos, sin,
                     rot is not None and rot.interleaved, self.cache["latent"], batch.slot_mapping)
            return
        k_pe = rot(k_pe.reshape(-1, 1, self.P), cos, sin)[:, 0]
        self.write_rows("latent", batch.slot_mapping, torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1))

    def _query(self, q_a: torch.Tensor, selects: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(c_q, q, the indexer's ``wq_b(c_q)`` or None): the query latent normed, then its projections,
        ``q_b_proj`` and, when the step ``selects`` keys, the indexer's ``wq_b`` (one GEMM once fused,
        ``fused_q``; without ``selects`` only ``q_b_proj``'s rows of it are read). With an RMSNorm and a plain or
        fused projection, one op (``rms_norm_linear``: on a decode step's few rows the norm runs inside the
        projection's kernel where that measured faster than the two apart)."""
        norm = self.q_a_layernorm
        fused = self._modules.get("fused_q") if selects else None
        up = fused if fused is not None else self.q_b_proj  # (q_b_proj's weight: a view of the fused one)
        if type(norm) is RMSNorm and (fused is not None or type(up) in PLAIN_LINEARS):
            y, c_q, _ = ops.call("rms_norm_linear", q_a, None, norm.scale(), norm.eps, up.weight, up.bias)
            outs = project(self, "fused_q", self.q_members, c_q, y) if fused is not None else (y,)
        else:
            c_q = norm(q_a)
            outs = project(self, "fused_q", self.q_members, c_q) if selects else (self.q_b_proj(c_q),)
        return c_q, outs[0], outs[1] if len(outs) > 1 else None

    def _step_rows(self, x, q_pe, c_kv, k_pe, proj, batch):
        """(q_pe rotated, whether the indexer's key was written): the query's rope channels rotated and
        the step's latent rows written, with the indexer's key as one op (``mla_step_rows``) where the rotary turns
        the whole rope key, else apart."""
        rot = self.rotary
        cos, sin = rot.step_cos_sin(batch) if rot is not None else (None, None)
        if rot is None or rot.dim != self.P:
            self._write_latent(c_kv, k_pe, cos, sin, batch)
            return (q_pe if rot is None else rot(q_pe, cos, sin)), False
        index = None
        if self.indexer is not None:
            index = self.indexer.key_args(x, batch, self.cache["index_k"], proj.get("indexer.wk"))
        q_pe = ops.call("mla_step_rows", q_pe, c_kv, self.kv_a_layernorm.scale(), self.kv_a_layernorm.eps, k_pe, cos,
                        sin, rot.interleaved, self.cache["latent"], batch.slot_mapping, index)
        return q_pe, index is not None

    def forward(self, x: torch.Tensor, batch, projected: torch.Tensor | None = None) -> torch.Tensor:
        """``projected``: ``fused_in(x)`` when the caller computed it (with the input norm, DecoderLayer._mix)."""
        T = x.shape[0]
        proj = dict(zip(self.in_proj_members, project(self, "fused_in", self.in_proj_members, x, projected)))
        # a step whose block tables address no more than topk keys selects them all: no query or weights needed
        selects = self.indexer is not None and batch.key_width > self.indexer.topk
        if self.spec.q_lora_rank:
            c_q, q, iq = self._query(proj["q_a_proj"], selects)
        else:
            c_q, q, iq = x, proj["q_proj"], None
        q_nope, q_pe = q.view(T, self.H, self.N + self.P).split([self.N, self.P], dim=-1)
        c_kv, k_pe = proj["kv_a_proj_with_mqa"].split([self.R, self.P], dim=-1)
        q_pe, written = self._step_rows(x, q_pe, c_kv, k_pe, proj, batch)
        if self.indexer is not None:
            iq, iw = self.indexer.project(x, c_q, batch, self.cache["index_k"], proj.get("indexer.wk"), iq, selects,
                                          key_written=written)

        if self.indexer is not None:
            selection = None
            if selects:
                selection = self.indexer.select(iq, iw, self.cache["index_k"], batch)  # [T, topk] key positions
            batch.selection, batch.selection_set = selection, True
        elif self.shares_selection:
            assert batch.selection_set, "a shared-index DSA layer needs an earlier layer that runs its indexer"
            selection = batch.selection
        else:
            selection = None
        out = ops.call("paged_mla", q_nope, q_pe, self.cache["latent"], self.kv_b_weight(), self.V, batch,
                       self.scale, self.sinks, selection)  # [T, H, V]
        if self.g_proj is not None:
            gate = proj["g_proj"] if "g_proj" in proj else self.g_proj(x)
            gate = gate.view(T, self.H, self.gate_width)  # per channel, or per head (width 1)
            y = fused_product(self.o_proj, lambda w, b: ops.call("sigmoid_gate_linear", out, gate, w, b))
            if y is not None:  # the gate inside the output projection
                return y
            out = ops.call("sigmoid_gate", out, gate)
        return self.o_proj(out.reshape(T, self.H * self.V))
