"""Random weights for tests and the bundled model: every tensor random, none left at a constant, so a
parity test cannot pass by skipping a norm, a bias or a correction term."""
from __future__ import annotations

import math

import torch


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    gens: dict[torch.device, torch.Generator] = {}

    def rand(shape):  # drawn where the parameter lives, so large models initialise on the GPU
        return torch.randn(shape, generator=g, dtype=torch.float32, device=g.device)

    for name, p in model.named_parameters():
        dev = p.device if p.device.type == "cuda" else torch.device("cpu")
        g = gens.setdefault(dev, torch.Generator(dev).manual_seed(seed))
        if not p.is_floating_point() or p.dtype.itemsize == 1:
            continue  # packed / fp8 storage has no meaningful random init
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            v = torch.log(torch.rand(p.shape, generator=g, device=g.device) * 15 + 1)  # decay rates in [1, 16]
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
