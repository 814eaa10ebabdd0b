"""The native ``dayzero_hybrid`` model: KDA, gated DSA and GQA layers with dense or (Latent)MoE MLPs.

Each layer's attention and MLP kind is fixed when the model is built; ``forward`` takes the flat batch
of one engine step and returns the hidden states of every scheduled token.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero.config.model_config import HybridConfig, LayerSpec
from dayzero.layers.attention.dsa import DSAAttention
from dayzero.layers.attention.gqa import GQAAttention
from dayzero.layers.attention.kda import KDAAttention
from dayzero.layers.mlp import MLP
from dayzero.layers.moe import MoE
from dayzero.layers.norm import RMSNorm

ATTENTION = {"kda": KDAAttention, "dsa": DSAAttention, "gqa": GQAAttention}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HybridConfig, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ATTENTION[spec.attn](cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if spec.mlp == "moe" else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, batch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class HybridBackbone(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, batch) -> torch.Tensor:
        x, residual = self.embed_tokens(batch.input_ids), None  # [T, D]
        for layer in self.layers:
            x, residual = layer(x, residual, batch)
        x, _ = self.norm(x, residual)
        return x


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: HybridConfig):
        super().__init__()
        self.config = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch) -> torch.Tensor:
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [S, D] -> [S, vocab] fp32 (lm_head used in fp32, as the references do)
        return torch.nn.functional.linear(hidden.float(), self.lm_head.weight.float())

    def cached_layers(self):
        """(layer index, attention module) of every layer that keeps a cache."""
        return [(i, layer.self_attn) for i, layer in enumerate(self.model.layers)]
