"""Random weights for tests and the bundled model: every tensor random, none left at a constant, so a
parity test cannot pass by skipping a norm, a bias or a correction term."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)

    def rand(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            v = torch.log(torch.rand(p.shape, generator=g) * 15 + 1)  # decay rates in [1, 16]
        elif leaf == "dt_bias" or leaf == "e_score_correction_bias" or leaf == "bias":
            v = 0.1 * rand(p.shape)
        elif "norm" in name:
            v = 1.0 + 0.1 * rand(p.shape)
        elif "conv1d" in name:
            v = rand(p.shape) / math.sqrt(p.shape[-1])
        else:
            v = std * rand(p.shape)
        p.copy_(v.to(p.dtype))
    return model
