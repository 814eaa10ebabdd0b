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
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype == torch.uint8 and leaf.endswith(("_blocks", "_scales")):  # packed MXFP4 experts
            if leaf.endswith("_blocks"):  # any two E2M1 codes a byte
                v = torch.randint(0, 256, p.shape, generator=g, device=g.device)
            else:  # E8M0 scales 2^-9 .. 2^-6: |w| up to 0.09, about the dense weights' size
                v = torch.randint(118, 122, p.shape, generator=g, device=g.device)
            p.copy_(v.to(torch.uint8))
            continue
        if p.dtype == torch.float8_e4m3fn:  # block-FP8 weights, their scales below
            p.copy_(rand(p.shape).clamp(-448, 448).to(p.dtype))
            continue
        if leaf.endswith("scale_inv"):  # one scale per FP8 tile: the weights come out about std-sized
            p.copy_(std * (0.5 + torch.rand(p.shape, generator=g, device=g.device)))
            continue
        if not p.is_floating_point() or p.dtype.itemsize == 1:
            continue  # other packed storage has no meaningful random init
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
