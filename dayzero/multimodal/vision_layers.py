"""Pieces the vision towers share: activations by config name, 2-D rotary, packed-segment attention, the ViT
block."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dayzero import ops

ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"vision hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def axial_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[head_dim/4] frequencies theta^(-4i/head_dim): each of the two axes gets half of the rotated pairs."""
    return 1.0 / theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 (the angles of a patch differ by up to a few hundred radians):
    x: [N, H, D]; cos, sin: [N, D] -> [N, H, D] in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """[S+1] int32 segment starts of the packed rows (0, l0, l0+l1, ...), on the host: the attention op slices
    each segment by them, and a device copy would be read back in every block (a sync per block)."""
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    return out


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      cu: torch.Tensor) -> torch.Tensor:
    """RoPE on q and k, then bidirectional attention within each segment of ``cu``.
    q, k, v: [N, H, D] -> [N, H*D]."""
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    out = ops.call("vision_attention", q, k, v, cu, q.shape[-1] ** -0.5)
    return out.flatten(1)


class VisionAttention(nn.Module):
    """Fused ``qkv`` (q and k rows in rotate-half order per head) and ``proj``, both with bias."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(self, x, cos, sin, cu):
        # x: [N, D] -> [N, 3, H, Dh]; q, k, v: [N, H, Dh]
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        return self.proj(segment_attention(q, k, v, cos, sin, cu))


class VisionMLP(nn.Module):
    """Up, activation, down; ``names``: what the family's checkpoints call the two linears."""

    def __init__(self, dim: int, hidden: int, act: str, names: tuple[str, str] = ("linear_fc1", "linear_fc2")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Linear(dim, hidden))
        setattr(self, names[1], nn.Linear(hidden, dim))
        self.act = activation(act)

    def forward(self, x):
        up, down = (getattr(self, n) for n in self.names)
        return down(self.act(up(x)))


class VisionBlock(nn.Module):
    """A pre-LN ViT block: bidirectional attention within each segment, then the MLP, each with its residual."""

    def __init__(self, dim: int, heads: int, hidden: int, act: str, eps: float,
                 mlp_names: tuple[str, str] = ("linear_fc1", "linear_fc2")):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.attn = VisionAttention(dim, heads)
        self.mlp = VisionMLP(dim, hidden, act, mlp_names)

    def forward(self, x, cos, sin, cu):
        x = x + self.attn(self.norm1(x), cos, sin, cu)
        return x + self.mlp(self.norm2(x))


class VisionOutput(NamedTuple):
    """A tower's output for the packed images: the features that replace the placeholder tokens, in image
    order, and the deep-stack features (one per deep-stack layer, same rows) added to early decoder layers."""

    features: torch.Tensor  # [M, D_text]
    deepstack: list[torch.Tensor]  # each [M, D_text]


def rope_theta(cfg: dict, default: float = 10000.0) -> float:
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def check_grids(pixel_values: torch.Tensor, grid_thw: torch.Tensor, merge: tuple[int, int]) -> list[tuple[int, ...]]:
    """grid_thw [I, 3] read to the host and checked against the packed rows and the merge window."""
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [images, 3], got {tuple(grid_thw.shape)}")
    grids = [tuple(int(v) for v in g) for g in grid_thw.tolist()]
    for t, h, w in grids:
        if t < 1 or h < 1 or w < 1 or h % merge[0] or w % merge[1]:
            raise ValueError(f"grid (t={t}, h={h}, w={w}) is not a positive grid of whole "
                             f"{merge[0]}x{merge[1]} windows")
    rows = sum(t * h * w for t, h, w in grids)
    if pixel_values.shape[0] != rows:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw {grids} makes {rows} patches")
    return grids
