"""The Kimi-K2.5 vision tower (MoonViT) and its projector, under transformers' names ``vision_tower.`` and
``mm_projector.`` (after its ``model.`` prefix), but for one fused ``attn.qkv`` per block.

- ``patch_embed.proj``: Conv2d(3 -> D, P/P, with bias) on each ``[3, P, P]`` patch.
- ``patch_embed.pos_emb.position_embeddings``: a learned ``[64, 64, D]`` grid, bicubically resampled
  (align_corners=False) to each image's (h, w); clips of t > 1 frames also add a fixed sin/cos embedding
  of the frame index (none for images).
- 2-D rotary, rotate-half over the whole head with angles ``[w*f0, h*f0, w*f1, h*f1, ... | same]``,
  ``f_i = theta^(-4i/head_dim)``. The checkpoints store ``wqkv`` for complex-pair (interleaved) rotation;
  ``attn.qkv`` holds the same [q; k; v] rows with the q/k rows of each head permuted from pairs to halves
  (what transformers' separate ``q_proj/k_proj/v_proj`` hold), done by the load rule's transform.
- ``layers``: pre-LN (eps 1e-5) blocks, ``qkv`` and ``proj`` with bias, GELU-tanh ``fc1/fc2`` MLP;
  attention spans a whole image (or clip); then ``final_layernorm``.
- Patch merge: each 2x2 window of the raster grid (averaged over the frames of a clip) -> [M, 4, D].
- ``mm_projector``: LayerNorm on each of the 4 patches, concatenated, ``in_proj``, GELU, ``out_proj`` -> D_text.

Checkpoint names (:func:`checkpoint_rules`) are the release's MoonViT ones, which transformers' ``save_pretrained``
writes too: ``encoder.blocks`` for ``layers``, ``norm0/1`` for ``norm1/2``, ``mlp.fc0/1`` for ``mlp.fc1/2``, ``wo``
for ``attn.proj``, ``pos_emb.weight``, ``mm_projector.proj.0/2`` for ``in_proj/out_proj``. Only two names differ
between them: transformers writes ``vision_tower.encoder.patch_embed.proj`` and ``model.mm_projector.pre_norm``
where the release has ``vision_tower.patch_embed.proj`` and ``mm_projector.pre_norm``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dayzero.loader.rules import Rule, pairs_to_halves
from dayzero.multimodal.vision_layers import (VisionBlock, VisionOutput, axial_inv_freq, check_grids, cu_seqlens,
                                              rope_theta)


# the release's ``vision_config`` keys -> transformers' (which win where both are present)
RELEASE_KEYS = {"vt_hidden_size": "hidden_size", "vt_num_hidden_layers": "num_hidden_layers",
                "vt_num_attention_heads": "num_attention_heads", "vt_intermediate_size": "intermediate_size",
                "init_pos_emb_height": "pos_emb_height", "init_pos_emb_width": "pos_emb_width",
                "init_pos_emb_time": "pos_emb_time"}


@dataclass(frozen=True)
class KimiK25VisionConfig:
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    num_attention_heads: int = 16
    num_hidden_layers: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    merge_kernel_size: tuple[int, int] = (2, 2)
    rope_theta: float = 10000.0
    text_hidden_size: int = 7168
    projection_layer_norm_eps: float = 1e-5

    @classmethod
    def from_hf(cls, config: dict) -> "KimiK25VisionConfig":
        """From a ``kimi_k25`` checkpoint's ``config.json`` (``vision_config`` and ``text_config.hidden_size``), in
        transformers' keys or the release's (``vt_hidden_size``, ``init_pos_emb_height``, ``projector_ln_eps``...)."""
        vc = config.get("vision_config") or {}
        vc = {**{name: vc[key] for key, name in RELEASE_KEYS.items() if key in vc}, **vc}
        d = cls()
        fields = {k: type(getattr(d, k))(vc[k]) for k in ("patch_size", "pos_emb_height", "pos_emb_width",
                                                          "pos_emb_time", "num_attention_heads",
                                                          "num_hidden_layers", "hidden_size", "intermediate_size",
                                                          "hidden_act") if k in vc}
        width = fields.get("hidden_size", d.hidden_size)
        proj = config.get("projection_hidden_size") or width
        if proj != width:
            raise ValueError(f"projection_hidden_size={proj} differs from the vision hidden_size={width}: the "
                             f"projector normalises each vision patch")
        text = int((config.get("text_config") or {}).get("hidden_size", vc.get("text_hidden_size", d.text_hidden_size)))
        return cls(**fields, merge_kernel_size=tuple(int(k) for k in vc.get("merge_kernel_size", d.merge_kernel_size)),
                   rope_theta=rope_theta(vc), text_hidden_size=text,
                   projection_layer_norm_eps=float(config.get("projection_layer_norm_eps",
                                                              vc.get("projector_ln_eps", d.projection_layer_norm_eps))))


class PositionEmbedding(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.position_embeddings = nn.Parameter(torch.zeros(cfg.pos_emb_height, cfg.pos_emb_width, cfg.hidden_size))

    def time_embedding(self, t: int, device) -> torch.Tensor:
        """[t, D] fp32 ``[sin(f*j) | cos(f*j)]`` of frame j, f = 10000^(-2i/D)."""
        D = self.cfg.hidden_size
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D)
        ang = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv
        return torch.cat((ang.sin(), ang.cos()), dim=-1)

    def forward(self, grids) -> torch.Tensor:
        # -> [N, D] fp32, raster order within each frame
        table = self.position_embeddings.float().permute(2, 0, 1)[None]  # [1, D, H0, W0]
        out = []
        for t, h, w in grids:
            e = F.interpolate(table, size=(h, w), mode="bicubic", align_corners=False)[0]  # [D, h, w]
            e = e.flatten(1).t()  # [h*w, D]
            if t > 1:
                if t > self.cfg.pos_emb_time:
                    raise ValueError(f"a clip of {t} frames is over pos_emb_time={self.cfg.pos_emb_time}")
                e = (e[None] + self.time_embedding(t, e.device)[:, None]).flatten(0, 1)
            out.append(e)
        return torch.cat(out)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: KimiK25VisionConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.hidden_size, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.pos_emb = PositionEmbedding(cfg)

    def forward(self, x: torch.Tensor, grids) -> torch.Tensor:
        # x: [N, 3, P, P] -> [N, D]; kernel == stride == the patch, so the conv is one GEMM
        w = self.proj.weight
        h = F.linear(x.reshape(x.shape[0], -1).to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)
        return h + self.pos_emb(grids).to(h.dtype)


class KimiK25VisionTower(nn.Module):
    """Patches -> merged windows [M, kh*kw, D] (transformers' ``Kimi_K25VisionModel``)."""

    def __init__(self, cfg: KimiK25VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.layers = nn.ModuleList(VisionBlock(cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size,
                                                cfg.hidden_act, eps=1e-5, mlp_names=("fc1", "fc2"))
                                    for _ in range(cfg.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=1e-5)

    def rotary(self, grids, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N, head_dim] fp32 for each patch's (row, column), raster order, every frame alike."""
        pos = []
        for t, h, w in grids:
            hw = torch.stack(torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij"), dim=-1)  # [h, w, 2]
            pos.append(hw.reshape(h * w, 2).repeat(t, 1))
        pos = torch.cat(pos).to(device).flip(-1).float()  # [N, 2] = (column, row)
        inv = axial_inv_freq(self.cfg.hidden_size // self.cfg.num_attention_heads, self.cfg.rope_theta).to(device)
        phi = (inv[:, None] * pos[:, None, :]).flatten(1)  # [N, Dh/2] = [col*f0, row*f0, col*f1, row*f1, ...]
        emb = torch.cat((phi, phi), dim=-1)
        return emb.cos(), emb.sin()

    def merge(self, x: torch.Tensor, grids) -> torch.Tensor:
        # x: [N, D] raster per frame -> [M, kh*kw, D]: 2x2 windows, the frames of a clip averaged in fp32
        kh, kw = self.cfg.merge_kernel_size
        out, start = [], 0
        for t, h, w in grids:
            xi = x[start:start + t * h * w].float().view(t, h // kh, kh, w // kw, kw, -1).mean(0)
            out.append(xi.permute(0, 2, 1, 3, 4).reshape((h // kh) * (w // kw), kh * kw, -1).to(x.dtype))
            start += t * h * w
        return torch.cat(out)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        # pixel_values: [N, 3, P, P]; grid_thw: [I, 3] -> [M, kh*kw, D]
        grids = check_grids(pixel_values, grid_thw, self.cfg.merge_kernel_size)
        x = self.patch_embed(pixel_values, grids)  # [N, D]
        cos, sin = self.rotary(grids, x.device)
        cu = cu_seqlens([t * h * w for t, h, w in grids])  # one segment per image or clip (host)
        for layer in self.layers:
            x = layer(x, cos, sin, cu)
        return self.merge(self.final_layernorm(x), grids)


class KimiK25Projector(nn.Module):
    """Merged windows -> text embeddings (transformers' ``Kimi_K25MultimodalProjection``)."""

    def __init__(self, cfg: KimiK25VisionConfig):
        super().__init__()
        width = cfg.hidden_size * cfg.merge_kernel_size[0] * cfg.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.projection_layer_norm_eps)
        self.in_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, cfg.text_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [M, kh*kw, D] -> [M, D_text]
        x = self.pre_norm(x).flatten(1)
        return self.out_proj(F.gelu(self.in_proj(x)))


class KimiK25Vision(nn.Module):
    """Tower and projector together; ``state_dict`` names are the checkpoint's after its ``model.`` prefix."""

    def __init__(self, cfg: KimiK25VisionConfig):
        super().__init__()
        self.vision_tower = KimiK25VisionTower(cfg)
        self.mm_projector = KimiK25Projector(cfg)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        # -> features [M, D_text], M = sum over images of (h/kh)*(w/kw); no deep stack
        return VisionOutput(self.mm_projector(self.vision_tower(pixel_values, grid_thw)), [])


# checkpoint name -> parameter of KimiK25Vision; ``(?:encoder\.)?`` and ``(?:model\.)?``: transformers' save
_NAMES = (
    (r"vision_tower\.(?:encoder\.)?patch_embed\.proj\.(weight|bias)", "vision_tower.patch_embed.proj.{0}"),
    (r"vision_tower\.patch_embed\.pos_emb\.weight", "vision_tower.patch_embed.pos_emb.position_embeddings"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.norm0\.(weight|bias)", "vision_tower.layers.{0}.norm1.{1}"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.norm1\.(weight|bias)", "vision_tower.layers.{0}.norm2.{1}"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.wo\.(weight|bias)", "vision_tower.layers.{0}.attn.proj.{1}"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0\.(weight|bias)", "vision_tower.layers.{0}.mlp.fc1.{1}"),
    (r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1\.(weight|bias)", "vision_tower.layers.{0}.mlp.fc2.{1}"),
    (r"vision_tower\.encoder\.final_layernorm\.(weight|bias)", "vision_tower.final_layernorm.{0}"),
    (r"(?:model\.)?mm_projector\.pre_norm\.(weight|bias)", "mm_projector.pre_norm.{0}"),
    (r"(?:model\.)?mm_projector\.proj\.0\.(weight|bias)", "mm_projector.in_proj.{0}"),
    (r"(?:model\.)?mm_projector\.proj\.2\.(weight|bias)", "mm_projector.out_proj.{0}"),
)


def checkpoint_rules(cfg: KimiK25VisionConfig, prefix: str = "") -> list[Rule]:
    """Load rules from the checkpoint's names onto a :class:`KimiK25Vision` held under ``prefix``: one tensor per
    parameter, the fused ``wqkv`` [3D, D] (and its bias) kept fused, its q and k rows reordered from pairs to
    halves per head."""
    halves = pairs_to_halves(cfg.num_attention_heads, parts=3, rotated=2)
    qkv = Rule(r"vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)",
               prefix + "vision_tower.layers.{0}.attn.qkv.{1}", transform=halves)
    return [qkv] + [Rule(pattern, prefix + target) for pattern, target in _NAMES]
