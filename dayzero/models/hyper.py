"""The decoder with hyper-connections (HY-V4, DeepSeek-V4's mHC): the residual stream is ``n`` parallel copies,
mixed by learned, input-dependent weights around every sublayer (the math is in ``ops/hyper``).

Each layer keeps the ordinary layer's sublayers and norms (it is a :class:`DecoderLayer`) and adds one
:class:`HyperConnection` per sublayer (``attn_hc``, ``ffn_hc``)::

    x, post, comb = hc_pre(h)    # [T, D] mixed from the n copies h [T, n, D]
    h = hc_post(h, post, f(norm(x)), comb)   # comb: the mHC stream mixing, None for HY-V4

The embedding starts every copy equal; a pre-only connection (``hc_head``) collapses the copies before the
final norm. Under tensor parallelism the streams are whole on every rank (each sublayer's output is all-reduced
before it is mixed in), so the connections are not split. ``model.layers[i](h, None, batch)`` returns ``(h, None)``: the streams after layer i,
[T, n, D], stand where other decoders return ``(x, residual)`` (whose sum is the residual stream).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import HyperSpec, LayerSpec, ModelSpec
from dayzero.layers.norm import RMSNorm
from dayzero.distributed import SINGLE, ParallelState, pp_send
from dayzero.layers.parallel import vocab_embedding
from dayzero.models.decoder import DecoderLayer, Elsewhere, Stages


class HyperConnection(nn.Module):
    """Mixing weights of one sublayer (``post=True``) or of the final collapse (``post=False``); fp32, as
    the reference keeps them. With ``spec.sinkhorn_iters`` a sublayer's connection also mixes the streams."""

    def __init__(self, hidden: int, spec: HyperSpec, norm_eps: float, post: bool = True):
        super().__init__()
        n = spec.streams
        parts = (3 if spec.sinkhorn_iters else 2) if post else 1  # [pre ‖ post ‖ comb], one scale each
        rows = (n, 2 * n, (2 + n) * n)[parts - 1]
        self.spec, self.norm_eps = spec, norm_eps
        self.fn = nn.Parameter(torch.empty(rows, n * hidden, dtype=torch.float32))
        # untrained values give equal pre weights summing to ~1; a checkpoint overwrites them
        self.base = nn.Parameter(torch.full((rows,), -math.log(max(n - 1, 1)), dtype=torch.float32))
        self.scale = nn.Parameter(torch.full((parts,), 0.01, dtype=torch.float32))

    def forward(self, h: torch.Tensor):
        # h: [T, n, D] -> x [T, D], post [T, n] (None for the final collapse), comb [T, n, n] (None without mHC)
        s = self.spec
        return ops.call("hc_pre", h, self.fn, self.base, self.scale, self.norm_eps, s.eps, s.post_magnitude,
                        None if s.post_eps else 0.0, s.sinkhorn_iters)


class HyperLayer(DecoderLayer):
    def __init__(self, m: ModelSpec, spec: LayerSpec, parallel: ParallelState = SINGLE):
        super().__init__(m, spec, parallel)
        D = m.hidden_size
        if spec.attn is not None:
            self.attn_hc = HyperConnection(D, m.hyper, m.rms_norm_eps)
        if spec.mlp is not None:
            self.ffn_hc = HyperConnection(D, m.hyper, m.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: None, batch):
        # h: [T, n, D]; ``residual`` is unused (the streams are the residual) and stays None
        if self.spec.attn is not None:
            x, post, comb = self.attn_hc(h)
            h = ops.call("hc_post", h, post, self.self_attn(self.input_layernorm(x), batch), comb)
        if self.spec.mlp is not None:
            x, post, comb = self.ffn_hc(h)
            h = ops.call("hc_post", h, post, self.mlp(self.post_attention_layernorm(x), batch), comb)
        return h, None


class HyperBackbone(Stages, nn.Module):
    def __init__(self, m: ModelSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self.streams = m.hyper.streams
        self._hold(m, parallel, lambda spec: HyperLayer(m, spec, parallel))
        self.embed_tokens = (vocab_embedding(m.vocab_size, m.hidden_size, parallel)
                             if self._embed_here(m.tie_word_embeddings) else Elsewhere("the first pipeline stage"))
        self.hc_head = HyperConnection(m.hidden_size, m.hyper, m.rms_norm_eps, post=False)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps, m.norm_offset)

    def forward(self, batch) -> torch.Tensor:
        if self.parallel.first_stage:
            x = self.embed_tokens(batch.input_ids)  # [T, D]
            h = x[:, None, :].expand(-1, self.streams, -1).contiguous()  # [T, n, D]: every copy starts equal
        else:  # the previous stage's streams
            h = self._arrive(batch, (self.streams, self.hidden))
        h, _ = self._run(h, None, batch)
        if not self.parallel.last_stage:
            pp_send(h, self.parallel)
            return h[:, 0]  # [T, D]; the last stage computes the logits
        x, _, _ = self.hc_head(h)
        return self.norm(x)
