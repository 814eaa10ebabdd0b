"""Image preprocessing for the vision towers: resize, rescale, normalise, cut into patch rows.

One processor per family, configured from a checkpoint's ``preprocessor_config.json`` with transformers'
defaults for what it leaves out, and giving the same ``pixel_values`` and ``image_grid_thw`` as
transformers' image processors on the same images:

- Qwen3-VL (``qwen3_vl_moe``, ``qwen3_5_moe``; transformers' ``Qwen2VLImageProcessorPil``): ``smart_resize``
  to multiples of patch*merge within [min_pixels, max_pixels], Pillow bicubic, the image tiled over
  ``temporal_patch_size`` frames, rows in 2x2 merge-window order of ``C*T*P*P`` values each.
- Kimi-K2.5 (``kimi_k25``): NaViT resize (never up, within a patch budget and a per-side limit), bicubic
  with antialiasing on the uint8 image as torchvision does it, zero padding bottom/right to multiples of
  patch*merge, rows of ``[C, P, P]`` in raster order.

Each image becomes ``grid_thw = (1, gh, gw)`` patches and ``gh * gw / merge**2`` placeholder tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dayzero.multimodal.image import DEFAULT_LIMITS, ImageLimits, load_image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200


@dataclass
class ImageInputs:
    """What the vision tower takes for a list of images, and what the prompt needs."""

    pixel_values: torch.Tensor  # Qwen3-VL: [N, C*T*P*P]; Kimi-K2.5: [N, C, P, P]; fp32
    grid_thw: torch.Tensor  # [I, 3] int64: patches per image along (t, h, w)
    num_tokens: list[int]  # placeholder tokens each image expands to in the prompt


def normalize(img: Image.Image | torch.Tensor, mean, std, rescale: float) -> torch.Tensor:
    """uint8 RGB (a Pillow image, or a [3, H, W] tensor) -> [3, H, W] fp32 ``(x * rescale - mean) / std``;
    the rescale in fp64 as transformers does it, then fp32."""
    x = img if isinstance(img, torch.Tensor) else torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1)
    x = (x.double() * rescale).float()
    m = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)
    return (x - m) / s


def _size_of(cfg: dict) -> dict:
    size = cfg.get("size")
    return size if isinstance(size, dict) else {}


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w), each a multiple of ``factor``, near the input's aspect ratio, with h*w in [min_pixels, max_pixels]."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is over "
                         f"{MAX_ASPECT_RATIO} ({width}x{height})")
    # Python's round (half to even), as the reference processor
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclass(frozen=True)
class Qwen3VLImageProcessor:
    """Qwen3-VL / Qwen3.5 images (defaults: transformers' ``Qwen2VLImageProcessor``; Qwen3-VL checkpoints
    set patch_size 16 and mean/std 0.5)."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    limits: ImageLimits = field(default=DEFAULT_LIMITS, compare=False)

    @classmethod
    def from_config(cls, cfg: dict, limits: ImageLimits = DEFAULT_LIMITS) -> "Qwen3VLImageProcessor":
        """From ``preprocessor_config.json``: ``size.shortest_edge/longest_edge`` are the pixel bounds, and a
        top-level ``min_pixels`` / ``max_pixels`` overrides them (as in transformers)."""
        d = cls()
        size = _size_of(cfg)
        return cls(
            patch_size=int(cfg.get("patch_size", d.patch_size)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", d.temporal_patch_size)),
            merge_size=int(cfg.get("merge_size", d.merge_size)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge", d.min_pixels)),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge", d.max_pixels)),
            image_mean=tuple(cfg.get("image_mean", d.image_mean)),
            image_std=tuple(cfg.get("image_std", d.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", d.rescale_factor)),
            limits=limits,
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens for an image of this size (from the size alone, before any pixel is read)."""
        h, w = self.resized_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def patchify(self, x: torch.Tensor) -> torch.Tensor:
        # x: [C, H, W] -> [gh*gw, C*T*P*P], rows in (gh/m, gw/m, m, m) order, columns (C, T, P, P)
        C, H, W = x.shape
        P, m, T = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = H // P, W // P
        x = x.view(C, gh // m, m, P, gw // m, m, P).permute(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, P, P]
        x = x.unsqueeze(5).expand(*x.shape[:5], T, P, P)  # a still image is the same frame T times
        return x.reshape(gh * gw, C * T * P * P)

    def __call__(self, images: list[Image.Image | bytes]) -> ImageInputs:
        rows, grids, tokens = [], [], []
        for image in images:
            img = load_image(image, self.limits)
            h, w = self.resized_size(img.height, img.width)
            img = img.resize((w, h), Image.Resampling.BICUBIC)
            rows.append(self.patchify(normalize(img, self.image_mean, self.image_std, self.rescale_factor)))
            grids.append((1, h // self.patch_size, w // self.patch_size))
            tokens.append(grids[-1][1] * grids[-1][2] // self.merge_size**2)
        return _pack(rows, grids, tokens, (3 * self.temporal_patch_size * self.patch_size**2,))


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_patches_per_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Kimi's resize: ((h, w) resized, (h, w) padded). Scales down (never up) until the image has at most
    ``max_patches`` patches and at most ``max_patches_per_side`` along each side; the padding rounds each
    side up to a multiple of patch*merge."""
    patches = max(1, height // patch_size) * max(1, width // patch_size)
    side = max_patches_per_side * patch_size
    scale = min(1.0, math.sqrt(max_patches / patches), side / height, side / width)
    h, w = min(max(1, int(height * scale)), side), min(max(1, int(width * scale)), side)
    f = patch_size * merge_size
    return (h, w), (-(-h // f) * f, -(-w // f) * f)


@dataclass(frozen=True)
class KimiK25ImageProcessor:
    """Kimi-K2.5 images (defaults: transformers' ``Kimi_K25ImageProcessor``). As in transformers, alpha is
    composited on white and the resize is torch's antialiased bicubic; the release's own processor drops
    alpha and resizes with Pillow, which differs by one grey level in well under 1% of the pixels."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384
    max_patches_per_side: int = 512
    image_mean: tuple[float, ...] = IMAGENET_STANDARD_MEAN
    image_std: tuple[float, ...] = IMAGENET_STANDARD_STD
    rescale_factor: float = 1 / 255
    limits: ImageLimits = field(default=DEFAULT_LIMITS, compare=False)

    @classmethod
    def from_config(cls, cfg: dict, limits: ImageLimits = DEFAULT_LIMITS) -> "KimiK25ImageProcessor":
        """From transformers' keys (``max_patches``, ``size.max_height``, ``merge_size``) or, where the file
        has it, the release's ``media_proc_cfg`` (``in_patch_limit``, ``patch_limit_on_one_side``,
        ``merge_kernel_size``), which transformers does not read; ``media_proc_cfg`` wins."""
        d = cls()
        media = cfg.get("media_proc_cfg") or {}
        merge = media.get("merge_kernel_size", cfg.get("merge_size", d.merge_size))
        merge = merge[0] if isinstance(merge, (list, tuple)) else merge

        def pick(name, media_name, default):
            return media.get(media_name, cfg.get(name, default))

        return cls(
            patch_size=int(pick("patch_size", "patch_size", d.patch_size)),
            merge_size=int(merge),
            max_patches=int(pick("max_patches", "in_patch_limit", d.max_patches)),
            max_patches_per_side=int(media.get("patch_limit_on_one_side",
                                               _size_of(cfg).get("max_height", d.max_patches_per_side))),
            image_mean=tuple(pick("image_mean", "image_mean", d.image_mean)),
            image_std=tuple(pick("image_std", "image_std", d.image_std)),
            rescale_factor=float(cfg.get("rescale_factor", d.rescale_factor)),
            limits=limits,
        )

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        return navit_resize(height, width, self.patch_size, self.merge_size, self.max_patches,
                            self.max_patches_per_side)

    def num_tokens(self, height: int, width: int) -> int:
        _, (h, w) = self.sizes(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size**2

    def __call__(self, images: list[Image.Image | bytes]) -> ImageInputs:
        rows, grids, tokens = [], [], []
        P = self.patch_size
        for image in images:
            img = load_image(image, self.limits)
            (h, w), (ph, pw) = self.sizes(img.height, img.width)
            x = torch.from_numpy(np.array(img, dtype=np.uint8)).permute(2, 0, 1).contiguous()  # [3, H, W] uint8
            if (h, w) != tuple(x.shape[1:]):
                # uint8 in, uint8 out: torchvision's CPU path for bicubic, which transformers uses
                x = F.interpolate(x[None], size=(h, w), mode="bicubic", align_corners=False, antialias=True)[0]
            x = F.pad(x, (0, pw - w, 0, ph - h))  # zero pixels: -1 after normalising with mean/std 0.5
            x = normalize(x, self.image_mean, self.image_std, self.rescale_factor)
            gh, gw = ph // P, pw // P
            # x: [3, H, W] -> [gh*gw, 3, P, P] in raster order
            rows.append(x.view(3, gh, P, gw, P).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, P, P))
            grids.append((1, gh, gw))
            tokens.append(gh * gw // self.merge_size**2)
        return _pack(rows, grids, tokens, (3, P, P))


def _pack(rows: list[torch.Tensor], grids: list[tuple[int, int, int]], tokens: list[int],
          row_shape: tuple[int, ...]) -> ImageInputs:
    pixels = torch.cat(rows) if rows else torch.zeros(0, *row_shape)  # no image: an empty batch of rows
    return ImageInputs(pixels, torch.tensor(grids, dtype=torch.int64).view(-1, 3), tokens)
