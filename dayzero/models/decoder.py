"""The decoder every architecture runs as: embeddings, one block per :class:`LayerSpec`, final norm, LM head.

Each layer's attention (or mixer) and MLP kind is fixed when the model is built; ``forward`` takes the
flat batch of one engine step and returns the hidden states of every scheduled token. A layer may have
only a mixer or only an MLP (Nemotron-H alternates them), in which case it has one norm.

The model is built for one :class:`~dayzero.distributed.ParallelState` (tp=1 by default). Under tensor parallelism
the embedding and LM head split the vocabulary, GQA its heads, dense MLPs and shared experts their intermediate
width; the mixers without a tensor-parallel form refuse tp>1 when built, naming themselves.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero.config.spec import (CompressedAttnSpec, GDNSpec, GQASpec, KDASpec, LayerSpec, Mamba2Spec, MLASpec, MLPSpec,
                                 ModelSpec, MoESpec)
from dayzero.distributed import SINGLE, ParallelState
from dayzero.layers.attention.compressed import CompressedAttention
from dayzero.layers.attention.dsa import MLAAttention
from dayzero.layers.attention.gdn import GatedDeltaNet
from dayzero.layers.attention.gqa import GQAAttention
from dayzero.layers.attention.kda import KDAAttention
from dayzero.layers.attention.mamba2 import Mamba2Mixer
from dayzero.layers.mlp import MLP
from dayzero.layers.moe import MoE
from dayzero.layers.norm import RMSNorm
from dayzero.layers.parallel import gather_logits, lm_head, vocab_embedding


def _tp1(what: str, build):
    """A builder for a mixer with no tensor-parallel form yet: it refuses tp>1, naming the mixer."""

    def builder(D, s, m, p: ParallelState):
        p.require_single(f"{what} mixer")
        return build(D, s, m)

    return builder


# spec type -> builder(hidden, spec, model spec, parallel state): every mixer kind, listed here and nowhere else
MIXERS = {
    GQASpec: lambda D, s, m, p: GQAAttention(D, s, m.rms_norm_eps, m.norm_offset, p),
    MLASpec: lambda D, s, m, p: MLAAttention(D, s, m.rms_norm_eps, p),
    KDASpec: lambda D, s, m, p: KDAAttention(D, s, m.rms_norm_eps, p),
    GDNSpec: _tp1("GatedDeltaNet", lambda D, s, m: GatedDeltaNet(D, s, m.rms_norm_eps)),
    Mamba2Spec: _tp1("Mamba-2", lambda D, s, m: Mamba2Mixer(D, s, m.rms_norm_eps)),
    CompressedAttnSpec: _tp1("compressed attention", lambda D, s, m: CompressedAttention(D, s)),
}
MLPS = {
    MLPSpec: lambda D, s, m, p: MLP(D, s, p),
    MoESpec: lambda D, s, m, p: MoE(D, s, m.rms_norm_eps, m.vocab_size, p),
}


class DecoderLayer(nn.Module):
    def __init__(self, m: ModelSpec, spec: LayerSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        D, eps, off = m.hidden_size, m.rms_norm_eps, m.norm_offset
        self.spec = spec
        if spec.attn is not None:
            self.input_layernorm = RMSNorm(D, eps, off)
            self.self_attn = MIXERS[type(spec.attn)](D, spec.attn, m, parallel)
        if spec.mlp is not None:
            self.post_attention_layernorm = RMSNorm(D, eps, off)
            self.mlp = MLPS[type(spec.mlp)](D, spec.mlp, m, parallel)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch):
        if self.spec.attn is not None:
            x, residual = self._norm(self.input_layernorm, x, residual)
            x = self.self_attn(x, batch)
        if self.spec.mlp is not None:
            x, residual = self._norm(self.post_attention_layernorm, x, residual)
            x = self.mlp(x, batch)
        return x, residual

    @staticmethod
    def _norm(norm, x, residual):
        if residual is None:
            return norm(x), x
        return norm(x, residual)


class Backbone(nn.Module):
    def __init__(self, m: ModelSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self.embed_tokens = vocab_embedding(m.vocab_size, m.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(m, spec, parallel) for spec in m.layers)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps, m.norm_offset)

    def forward(self, batch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None  # [T, D]
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    def __init__(self, m: ModelSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self.config = m
        self.parallel = parallel
        if m.hyper is not None:  # n residual streams instead of one
            from dayzero.models.hyper import HyperBackbone

            parallel.require_single("hyper-connection backbone")
            self.model = HyperBackbone(m)
        else:
            self.model = Backbone(m, parallel)
        self.lm_head = lm_head(m.hidden_size, m.vocab_size, parallel)
        if m.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch) -> torch.Tensor:
        memo = getattr(batch, "memo", None)
        if memo is not None:  # what a forward pass computes once for all its layers (a captured one included)
            memo.clear()
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, D] -> [S, vocab] fp32. An fp32 lm_head (the CPU references) runs in fp32; a bf16 one as one
        # bf16 GEMM with fp32 accumulation: upcasting its weight would copy [vocab, D] fp32 every step. Under
        # tensor parallelism each rank computes its vocabulary rows and the logits are gathered.
        w = self.lm_head.weight
        if w.dtype == torch.float32:
            logits = torch.nn.functional.linear(hidden.float(), w)
        else:
            logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        return gather_logits(logits, self.config.vocab_size, self.parallel)

    def cached_layers(self):
        """(layer index, mixer module) of every layer that keeps a cache."""
        return [(i, layer.self_attn) for i, layer in enumerate(self.model.layers) if hasattr(layer, "self_attn")]
