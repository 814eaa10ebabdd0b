"""Shared by the linear-attention op tests: packed varlen inputs, tolerances, and splitting a batch into
two calls that carry state from the first to the second."""
from __future__ import annotations

import torch

# tolerances, stated once: relative Frobenius error, per dtype
RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0)


def assert_close(a, b, rtol, what=""):
    a, b = a.double(), b.double()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.isfinite(a).all(), f"{what}: non-finite values"
    ref = b.norm().item()
    rel = (a - b).norm().item() / max(ref, 1e-30)
    max_abs = (a - b).abs().max().item() if a.numel() else 0.0
    assert rel <= rtol, f"{what}: rel err {rel:.3e} > {rtol:.1e} (max abs {max_abs:.3e}, |ref| {ref:.3e})"


def split(inp: dict, first, per_token) -> tuple[dict, dict, list[int], list[int]]:
    """Split every sequence after first[i] tokens: the inputs of the two calls and their rows."""
    b = inp["cu_seqlens"].tolist()
    rows1 = [r for i, f in enumerate(first) for r in range(b[i], b[i] + f)]
    rows2 = [r for i, f in enumerate(first) for r in range(b[i] + f, b[i + 1])]
    lens = [b[i + 1] - b[i] for i in range(len(first))]
    a = {**inp, **{n: inp[n][rows1] for n in per_token}, "cu_seqlens": cu(first)}
    c = {**inp, **{n: inp[n][rows2] for n in per_token}, "cu_seqlens": cu([n - f for n, f in zip(lens, first)])}
    return a, c, rows1, rows2
