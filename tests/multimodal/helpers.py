"""Shared by the multimodal tests: tiny transformers reference models and how outputs are compared."""
from __future__ import annotations

import torch

RTOL = 1e-5  # fp32 towers: max |ours - theirs| / max |theirs|


@torch.no_grad()
def perturb_constant(module: torch.nn.Module, seed: int = 1) -> None:
    """Noise on every parameter whose values are all equal (fresh norms are 1, biases 0), so a tower that
    skipped a norm or a bias would not match by accident."""
    g = torch.Generator().manual_seed(seed)
    for _, t in module.named_parameters():
        if t.numel() > 1 and bool((t == t.flatten()[0]).all()):
            t.add_(0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype))


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, rtol: float = RTOL) -> None:
    assert ours.shape == theirs.shape, f"{tuple(ours.shape)} != {tuple(theirs.shape)}"
    err = (ours.double() - theirs.double()).abs().max().item()
    scale = theirs.double().abs().max().item()
    assert err <= rtol * max(scale, 1e-12), f"max abs error {err:.3g} over {rtol} x max |ref| {scale:.3g}"


def packed_pixels(grid: list[list[int]], row_shape: tuple[int, ...],
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random pixel rows for the images of ``grid`` (rows [t, h, w]) packed together, and the grid tensor."""
    g = torch.tensor(grid, dtype=torch.int64)
    n = int(g.prod(-1).sum())
    return torch.randn((n, *row_shape), generator=torch.Generator().manual_seed(seed)), g
