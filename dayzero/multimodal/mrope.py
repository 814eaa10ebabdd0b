"""Multimodal RoPE positions of a prompt (Qwen3-VL, Qwen3.5), as transformers' ``get_rope_index`` gives them.

Text advances the three axes (t, h, w) together by one a token. An image after text that ended at
position p - 1 covers its merged grid ``(gt, gh/m, gw/m)``: its token (i, j, k), in the grid's raster order,
is at ``(p + i, p + j, p + k)`` (the temporal index unscaled: a still image has one frame after the
processor's temporal tiling). The text after it continues from ``p + max(gh, gw) / m``. Tokens past the
prompt (generated ones) sit at ``index + delta`` on all three axes, ``delta = max position + 1 - L``.
"""
from __future__ import annotations

import torch


def mrope_positions(length: int, images, merge: int) -> tuple[torch.Tensor, int]:
    """``images``: (start, grid (t, h, w)) of each image in prompt order, its tokens at start..; -> the
    [3, length] int64 positions and the rope delta."""
    pos = torch.empty(3, length, dtype=torch.int64)
    at, p = 0, 0  # next prompt index, next position
    for start, (t, h, w) in images:
        n = start - at  # the text before this image
        pos[:, at:start] = torch.arange(p, p + n)
        p += n
        gt, gh, gw = t, h // merge, w // merge
        ti, hi, wi = torch.meshgrid(torch.arange(gt), torch.arange(gh), torch.arange(gw), indexing="ij")
        pos[:, start:start + gt * gh * gw] = torch.stack((ti, hi, wi)).reshape(3, -1) + p
        at = start + gt * gh * gw
        p += max(gh, gw)
    pos[:, at:] = torch.arange(p, p + length - at)
    delta = int(pos.max()) + 1 - length if length else 0
    return pos, delta
