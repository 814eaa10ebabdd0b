"""The decoder every architecture runs as: embeddings, one block per :class:`LayerSpec`, final norm, LM head.

Each layer's attention (or mixer) and MLP kind is fixed when the model is built; ``forward`` takes the
flat batch of one engine step and returns the hidden states of every scheduled token. A layer may have
only a mixer or only an MLP (Nemotron-H alternates them), in which case it has one norm.

The model is built for one :class:`~dayzero.distributed.ParallelState` (tp=1 by default). Under tensor parallelism
the embedding and LM head split the vocabulary, every mixer (GQA, MLA and DSA, KDA, Gated DeltaNet, Mamba-2,
compressed attention) its heads, dense MLPs, shared experts and (without expert parallelism) routed experts their
intermediate width; hyper-connection streams stay whole on every rank.

Under pipeline parallelism a stage builds only its contiguous run of layers (:func:`pipeline_stages`):
the others, and the embedding and LM head where another stage holds them, are :class:`Elsewhere` placeholders,
so layer indices and parameter names stay those of the whole model. A stage receives the residual stream (the
hyper-connection streams) from the previous one, runs its layers and sends the stream on; the last stage's
logits are broadcast to every stage, so every rank samples the same tokens.

Images (``batch.images``, a :class:`~dayzero.multimodal.inputs.StepImages`, or None): the vision tower's
features replace the embeddings of the step's image placeholder rows, and deep-stack features (Qwen3-VL) are
added to those rows of the residual stream after each of the first ``len(deepstack)`` layers. A step without
image rows has ``images`` None and runs exactly the text path.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import (CompressedAttnSpec, GDNSpec, GQASpec, KDASpec, LayerSpec, Mamba2Spec, MLASpec, MLPSpec,
                                 ModelSpec, MoESpec)
from dayzero.distributed import SINGLE, ParallelState, pipeline_stages, pp_broadcast_last, pp_recv, pp_send
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


# spec type -> builder(hidden, spec, model spec, parallel state): every mixer kind, listed here and nowhere else
MIXERS = {
    GQASpec: lambda D, s, m, p: GQAAttention(D, s, m.rms_norm_eps, m.norm_offset, p),
    MLASpec: lambda D, s, m, p: MLAAttention(D, s, m.rms_norm_eps, p),
    KDASpec: lambda D, s, m, p: KDAAttention(D, s, m.rms_norm_eps, p),
    GDNSpec: lambda D, s, m, p: GatedDeltaNet(D, s, m.rms_norm_eps, p),
    Mamba2Spec: lambda D, s, m, p: Mamba2Mixer(D, s, m.rms_norm_eps, p),
    CompressedAttnSpec: lambda D, s, m, p: CompressedAttention(D, s, p),
}
MLPS = {
    MLPSpec: lambda D, s, m, p: MLP(D, s, p),
    MoESpec: lambda D, s, m, p: MoE(D, s, m.rms_norm_eps, m.vocab_size, p),
}


# torch.mm(..., out_dtype=torch.float32) of fp16 / bf16 operands (a CUDA overload of torch 2.8+)
MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


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
            x, residual = self._mix(self.input_layernorm, self.self_attn, x, residual, batch)
        if self.spec.mlp is not None:
            x, residual = self._mix(self.post_attention_layernorm, self.mlp, x, residual, batch)
        return x, residual

    def _mix(self, norm: nn.Module, mixer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, batch):
        """``mixer(norm(x + residual))`` and the new residual. A mixer whose first step is its fused input
        projection (``takes_projected``) gets it from here, computed with the norm (``rms_norm_linear``: on a
        decode step's few rows one kernel where the norm and the GEMM were two). A MoE that routes first
        (``router_first``) gets its router's logits that way instead, and projects its input after them."""
        router = mixer.router_first() if type(norm) is RMSNorm and hasattr(mixer, "router_first") else None
        if router is not None:  # the MoE router's logits with the norm; the experts' projection after them
            logits, x, residual = ops.call("rms_norm_linear", x, residual, norm.scale(), norm.eps, router.weight,
                                           router.bias, torch.float32)
            return mixer(x, batch, logits=logits), residual
        fused = mixer._modules.get("fused_in") if getattr(mixer, "takes_projected", False) else None
        if fused is None or type(norm) is not RMSNorm:
            x, residual = self._norm(norm, x, residual)
            return mixer(x, batch), residual
        proj, x, residual = ops.call("rms_norm_linear", x, residual, norm.scale(), norm.eps, fused.weight, fused.bias)
        return mixer(x, batch, projected=proj), residual

    @staticmethod
    def _norm(norm, x, residual):
        if residual is None:
            return norm(x), x
        return norm(x, residual)


class Elsewhere(nn.Module):
    """A part of the model another pipeline stage holds (a decoder layer, the embedding, the LM head)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def extra_repr(self) -> str:
        return f"held by {self.where}"


class Stages:
    """What a pipeline stage holds and how its stream arrives and leaves (mixed into both backbones)."""

    def _hold(self, m: ModelSpec, parallel: ParallelState, layer) -> None:
        self.parallel, self.dtype, self.hidden = parallel, torch.get_default_dtype(), m.hidden_size
        stages = pipeline_stages(len(m.layers), parallel.pp_size)
        self.held = stages[parallel.pp_rank]
        stage_of = {i: s for s, run in enumerate(stages) for i in run}
        self.layers = nn.ModuleList(layer(spec) if i in self.held else Elsewhere(f"pipeline stage {stage_of[i]}")
                                    for i, spec in enumerate(m.layers))
        shared = [i for i in self.held if _shares_selection(m.layers[i])]
        own = [i for i in self.held if _runs_indexer(m.layers[i])]
        if shared and (not own or own[0] > shared[0]):
            raise ValueError(f"pp={parallel.pp_size}: layer {shared[0]} reuses the DSA selection of a layer on an "
                             "earlier stage; choose a pp that starts each stage at an indexer layer")

    def _embed_here(self, tied: bool) -> bool:
        return self.parallel.first_stage or (tied and self.parallel.last_stage)

    def _arrive(self, batch, shape: tuple[int, ...]) -> torch.Tensor:
        """The stream [T, *shape] from the previous stage."""
        ids = batch.input_ids
        return pp_recv((ids.shape[0],) + shape, self.dtype, ids.device, self.parallel)

    def _run(self, x, residual, batch):
        images = getattr(batch, "images", None)
        deep = images.deepstack if images is not None else ()
        for i in self.held:
            x, residual = self.layers[i](x, residual, batch)
            if i < len(deep):  # the stream is x + residual: adding to x adds to it
                x = x.index_add(0, images.rows, deep[i].to(x.dtype))
        return x, residual


def _runs_indexer(spec: LayerSpec) -> bool:
    return isinstance(spec.attn, MLASpec) and spec.attn.indexer is not None and not spec.attn.indexer.shared


def _shares_selection(spec: LayerSpec) -> bool:
    return isinstance(spec.attn, MLASpec) and spec.attn.indexer is not None and spec.attn.indexer.shared


class Backbone(Stages, nn.Module):
    def __init__(self, m: ModelSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self._hold(m, parallel, lambda spec: DecoderLayer(m, spec, parallel))
        self.embed_tokens = (vocab_embedding(m.vocab_size, m.hidden_size, parallel)
                             if self._embed_here(m.tie_word_embeddings) else Elsewhere("the first pipeline stage"))
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps, m.norm_offset)

    def forward(self, batch) -> torch.Tensor:
        p = self.parallel
        x = self.embed_tokens(batch.input_ids) if p.first_stage else self._arrive(batch, (self.hidden,))  # [T, D]
        images = getattr(batch, "images", None)
        if images is not None and p.first_stage:
            x = x.index_copy(0, images.rows, images.embeds.to(x.dtype))  # image rows: the tower's features
        x, residual = self._run(x, None, batch)
        if not p.last_stage:  # the residual stream goes on as one tensor
            pp_send(x if residual is None else x + residual, p)
            return x
        x, _ = self.norm(x, residual)
        return x


# Rows a pipeline micro-batch needs before cutting a step pays: on two CPU ranks (docs/performance.md, "Pipeline
# micro-batches") parts of 16 decode rows ran no faster than whole steps (each part pays the per-layer fixed costs
# and a send), parts of 64 rows 1.2x faster.
MICRO_BATCH_MIN_ROWS = 32


class CausalLM(nn.Module):
    def __init__(self, m: ModelSpec, parallel: ParallelState = SINGLE):
        super().__init__()
        self.config = m
        self.parallel = parallel
        if m.hyper is not None:  # n residual streams instead of one
            from dayzero.models.hyper import HyperBackbone

            self.model = HyperBackbone(m, parallel)
        else:
            self.model = Backbone(m, parallel)
        self.lm_head = (lm_head(m.hidden_size, m.vocab_size, parallel) if parallel.last_stage
                        else Elsewhere("the last pipeline stage"))
        if m.tie_word_embeddings and parallel.last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight
        # parameter-name prefixes other stages hold: the loader leaves their checkpoint tensors alone
        self.elsewhere = tuple(f"{n}." for n, mod in self.named_modules() if isinstance(mod, Elsewhere))
        # Pipeline micro-batches: an eager step of several sequences runs as up to this many parts of consecutive
        # sequences, one after another, so that a stage computes part i + 1 while the next stage computes part i
        # (the engine sets it: by default twice the stages), each part of at least
        # ``micro_batch_min_rows`` rows. Each part is a whole batch to the layers.
        self.micro_batches = 1
        self.micro_batch_min_rows = MICRO_BATCH_MIN_ROWS
        self.split_steps = 0  # steps run in parts

    def forward(self, batch) -> torch.Tensor:
        parts = None
        if self.micro_batches > 1 and hasattr(batch, "split"):
            parts = batch.split(min(self.micro_batches, batch.num_tokens // max(self.micro_batch_min_rows, 1)))
        if parts is None:
            return self._forward(batch)
        self.split_steps += 1
        return torch.cat([self._forward(part) for part in parts])

    def _forward(self, batch) -> torch.Tensor:
        memo = getattr(batch, "memo", None)
        if memo is not None:  # what a forward pass computes once for all its layers (a captured one included)
            memo.clear()
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, D] -> [S, vocab] fp32. An fp32 lm_head (the CPU references) runs in fp32; a bf16 one as one
        # bf16 GEMM with fp32 accumulation: upcasting its weight would copy [vocab, D] fp32 every step. Under
        # tensor parallelism each rank computes its vocabulary rows and the logits are gathered; under pipeline
        # parallelism the last stage computes them and every stage receives them.
        if not self.parallel.last_stage:
            out = torch.empty(hidden.shape[0], self.config.vocab_size, dtype=torch.float32, device=hidden.device)
            return pp_broadcast_last(out, self.parallel)
        w = self.lm_head.weight
        if w.dtype == torch.float32:
            logits = torch.nn.functional.linear(hidden.float(), w)
        elif hidden.is_cuda and hidden.dim() == 2 and MM_OUT_DTYPE:  # cuBLAS writes the fp32 logits: no cast after
            logits = torch.mm(hidden.to(w.dtype), w.t(), out_dtype=torch.float32)
        else:
            logits = torch.nn.functional.linear(hidden.to(w.dtype), w).float()
        return pp_broadcast_last(gather_logits(logits, self.config.vocab_size, self.parallel), self.parallel)

    def cached_layers(self):
        """(layer index, mixer module) of every layer that keeps a cache."""
        return [(i, layer.self_attn) for i, layer in enumerate(self.model.layers) if hasattr(layer, "self_attn")]
