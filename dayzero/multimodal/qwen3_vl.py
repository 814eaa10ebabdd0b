"""The Qwen3-VL vision tower, shared by ``qwen3_vl_moe`` and ``qwen3_5_moe`` (checkpoint prefix ``model.visual.``).

- ``patch_embed.proj``: Conv3d(C -> D, kernel = stride = (T, P, P), with bias) over each row of
  ``C*T*P*P`` pixel values, i.e. one linear map.
- ``pos_embed``: a learned square table of ``num_position_embeddings`` rows, bilinearly resampled
  (align_corners) to each image's (h, w) patch grid and added to the patch embeddings.
- 2-D rotary on q and k: rotate-half over the whole head, angles ``[h*f | w*f | h*f | w*f]`` with
  ``f = theta^(-4i/head_dim)``, ``i < head_dim/4``.
- ``blocks``: pre-LN (LayerNorm, eps 1e-6) ViT blocks; fused ``qkv`` with bias; ``linear_fc1/2`` MLP.
  Attention is bidirectional within each frame of each image.
- ``merger``: LayerNorm on each patch, then 2x2 windows concatenated, Linear, GELU, Linear -> D_text.
- ``deepstack_merger_list``: one merger per deep-stack layer (LayerNorm after the concatenation), applied
  to that layer's output; Qwen3-VL feeds them to its first decoder layers. Qwen3.5's tower is the same
  without deep-stack mergers (transformers' ``Qwen3_5MoeVisionModel`` has none and returns none).

Rows arrive in merge-window order (the processor's), so the 4 patches of each window are adjacent and
every per-patch quantity (position embedding, rotary angle) is laid out in that order too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dayzero.multimodal.vision_layers import (VisionBlock, VisionOutput, axial_inv_freq, check_grids, cu_seqlens,
                                              rope_theta)

DEEPSTACK_LAYERS = (8, 16, 24)  # transformers' default for Qwen3-VL


@dataclass(frozen=True)
class Qwen3VLVisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = DEEPSTACK_LAYERS
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, config: dict) -> "Qwen3VLVisionConfig":
        """From a checkpoint's ``config.json`` (its ``vision_config``) or the ``vision_config`` dict alone.
        ``qwen3_5*`` towers have no deep stack whatever the dict says, as in transformers."""
        vc = config.get("vision_config", config)
        family = str(config.get("model_type") or vc.get("model_type") or "")
        d = cls()
        fields = {k: type(getattr(d, k))(vc[k]) for k in ("depth", "hidden_size", "hidden_act", "intermediate_size",
                                                          "num_heads", "in_channels", "patch_size",
                                                          "spatial_merge_size", "temporal_patch_size",
                                                          "out_hidden_size", "num_position_embeddings") if k in vc}
        deep = () if family.startswith("qwen3_5") else tuple(vc.get("deepstack_visual_indexes", DEEPSTACK_LAYERS))
        return cls(**fields, deepstack_visual_indexes=tuple(int(i) for i in deep), rope_theta=rope_theta(vc))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, C*T*P*P] -> [N, D]; kernel == stride == the whole row, so the conv is one GEMM
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    """2x2 windows of patches -> one token of the text model's width. ``postshuffle``: LayerNorm over the
    concatenated window (deep-stack mergers) instead of over each patch (the final merger)."""

    def __init__(self, cfg: Qwen3VLVisionConfig, postshuffle: bool):
        super().__init__()
        self.width = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, D] in merge-window order -> [N/m^2, D_text]
        x = self.norm(x.view(-1, self.width)) if self.postshuffle else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VLVision(nn.Module):
    def __init__(self, cfg: Qwen3VLVisionConfig):
        super().__init__()
        self.cfg = cfg
        self.side = int(cfg.num_position_embeddings**0.5)
        if self.side**2 != cfg.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={cfg.num_position_embeddings} is not a square grid")
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.hidden_act,
                                                eps=1e-6) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(cfg, postshuffle=True)
                                                   for _ in cfg.deepstack_visual_indexes)

    def window_order(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        # x: [h, w, ...] raster -> [h*w, ...] in (h/m, w/m, m, m) merge-window order
        m = self.cfg.spatial_merge_size
        return x.reshape(h // m, m, w // m, m, *x.shape[2:]).transpose(1, 2).reshape(h * w, *x.shape[2:])

    def position_embedding(self, grids) -> torch.Tensor:
        """[N, D]: the learned table resampled to each image's grid (fp32), repeated over its frames."""
        D = self.cfg.hidden_size
        table = self.pos_embed.weight.float().view(self.side, self.side, D).permute(2, 0, 1)[None]  # [1, D, s, s]
        out = []
        for t, h, w in grids:
            e = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [D, h, w]
            out.append(self.window_order(e.permute(1, 2, 0), h, w).repeat(t, 1))
        return torch.cat(out)

    def rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, head_dim] fp32 for each patch's (row, column)."""
        pos = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)  # [h, w, 2]
            pos.append(self.window_order(hw, h, w).repeat(t, 1))
        pos = torch.cat(pos).to(device)  # [N, 2]
        inv = axial_inv_freq(self.cfg.hidden_size // self.cfg.num_heads, self.cfg.rope_theta).to(device)
        phi = (pos[:, :, None].float() * inv).flatten(1)  # [N, Dh/2] = [row * f | col * f]
        emb = torch.cat((phi, phi), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        # pixel_values: [N, C*T*P*P] (rows of all images); grid_thw: [I, 3] -> features [N/m^2, D_text]
        m = self.cfg.spatial_merge_size
        grids = check_grids(pixel_values, grid_thw, (m, m))
        x = self.patch_embed(pixel_values)  # [N, D]
        x = x + self.position_embedding(grids).to(x.dtype)
        cos, sin = self.rotary(grids, x.device)
        cu = cu_seqlens([h * w for t, h, w in grids for _ in range(t)])  # one segment per frame (host)
        index = list(self.cfg.deepstack_visual_indexes)
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, cu)
            if i in index:
                deepstack.append(self.deepstack_merger_list[index.index(i)](x))
        return VisionOutput(self.merger(x), deepstack)
