"""Images for ``dayzero align`` and ``dayzero profile``: image files read, the family's placeholder put into
token-id prompts, each prompt's pixel rows and widened ids, and the vision tower's layers named for hooks.

The layers of a Qwen3-VL tower, in the order they run: block i (``v<i>``), the deep-stack merger that reads
block i's output right after it (``ds<j>``, Qwen3-VL only), and the final merger (``merger``). Transformers'
tower (``model.model.visual``) and ours (``model.visual``) have the same module names, so one walk names both.
Kimi-K2.5 keeps its tower and projector side by side (``vision_tower.layers``, ``mm_projector``; transformers'
under ``model.model``, ours in :class:`~dayzero.multimodal.kimi_k25.KimiK25Vision`): its blocks are ``v<i>`` and
the projector, which merges each 2x2 window into one text embedding, is its ``merger``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

# the families whose images run through the engine
VISION_FAMILIES = ("qwen3_5_moe", "qwen3_vl_moe", "kimi_k25")
VISION_KIND = "vision"


def read_images(paths) -> list[bytes]:
    """The encoded bytes of each image file (decoded and checked later, as a request's images are)."""
    out = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise ValueError(f"--image {p}: no such file")
        out.append(p.read_bytes())
    return out


def vision_config(model: str | Path, option: str = "--image") -> tuple[dict, object]:
    """(config.json, vision family) of a checkpoint whose images run through the engine; ValueError naming the
    reason for any other."""
    from dayzero.models.registry import read_config
    from dayzero.multimodal.families import vision_family

    raw, _ = read_config(model)
    model_type = raw.get("model_type")
    family = vision_family(raw)
    if family is None:
        raise ValueError(f"{model} is a text-only model (model_type {model_type!r}, no vision tower): {option} needs a "
                         f"vision-language checkpoint ({', '.join(VISION_FAMILIES)})")
    if model_type not in VISION_FAMILIES:
        raise ValueError(f"{model}: images of {model_type!r} do not run through the engine yet; {option} takes "
                         f"{', '.join(VISION_FAMILIES)}")
    return raw, family


def processor_of(model: str | Path, raw: dict, family):
    from dayzero.multimodal.families import read_preprocessor_config

    return family.processor(raw, read_preprocessor_config(Path(model)))


def placeholder(raw: dict, family) -> list[int]:
    """The token ids the chat template writes for one image: ``<|vision_start|><|image_pad|><|vision_end|>``."""
    image = family.image_token_id(raw)
    start, end = raw.get("vision_start_token_id"), raw.get("vision_end_token_id")
    return [int(start), image, int(end)] if start is not None and end is not None else [image]


def special_ids(raw: dict, family) -> set[int]:
    """Ids a random text token must not be: the image placeholder, video and vision start/end tokens."""
    names = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
    return {family.image_token_id(raw)} | {int(raw[k]) for k in names if raw.get(k) is not None}


def random_text(n: int, vocab_size: int, avoid: set[int], g: torch.Generator) -> list[int]:
    """``n`` token ids drawn from the vocab without the ``avoid`` ids."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[[i for i in avoid if 0 <= i < vocab_size]] = False
    allowed = keep.nonzero().flatten()
    return allowed[torch.randint(0, len(allowed), (n,), generator=g)].tolist()


def with_images(prompts: list[list[int]], images: list, image_token: int, ph: list[int],
                middle: bool = False) -> list[list]:
    """Each prompt's images. Prompts that hold placeholder tokens take the images in order (their count must be
    the images'); prompts that hold none each get every image, its placeholder ``ph`` put before the text (or
    in its middle, ``middle``), as a chat turn with an image part. The prompts are changed in place."""
    found = [sum(t == image_token for t in p) for p in prompts]
    if not any(found):
        for i, p in enumerate(prompts):
            at = len(p) // 2 if middle else 0
            prompts[i] = p[:at] + ph * len(images) + p[at:]
        return [list(images) for _ in prompts]
    if sum(found) != len(images):
        raise ValueError(f"the prompts hold {sum(found)} image placeholder(s) (token {image_token}) but {len(images)} "
                         f"image(s) were given: one placeholder per image, in order (or none, and every prompt "
                         f"gets every image)")
    out, k = [], 0
    for n in found:
        out.append(list(images[k:k + n]))
        k += n
    return out


@dataclass
class PromptInputs:
    """One prompt as both sides see it: the ids with one placeholder per image (what the engine takes), and the
    widened ids with the processor's pixel rows (what transformers takes)."""

    ids: list[int]
    images: list
    wide: list[int]
    pixel_values: torch.Tensor | None = None
    grid_thw: torch.Tensor | None = None


def prompt_inputs(model: str | Path, prompts: list[list[int]], images: list[list]) -> list[PromptInputs]:
    """Every prompt's inputs, with ``model``'s image processor."""
    from dayzero.multimodal.inputs import expand_placeholders

    raw, family = vision_config(model)
    processor, image_token = processor_of(model, raw, family), family.image_token_id(raw)
    out = []
    for ids, imgs in zip(prompts, images):
        if not imgs:
            out.append(PromptInputs(ids, [], ids))
            continue
        x = processor(imgs)
        wide, _ = expand_placeholders(ids, image_token, x.num_tokens)
        out.append(PromptInputs(ids, imgs, wide, x.pixel_values, x.grid_thw))
    return out


@dataclass(frozen=True)
class VisionPoint:
    name: str  # "v3", "ds0", "merger"
    module: torch.nn.Module
    merged: bool  # a merger: one output row per merge window, not per patch


def vision_points(tower: torch.nn.Module) -> list[VisionPoint]:
    """The tower's layers in the order they run (see the module docstring)."""
    if _side_by_side(tower):  # Kimi-K2.5: the tower's blocks, then the projector
        blocks = tower.vision_tower.layers
        return [VisionPoint(f"v{i}", b, False) for i, b in enumerate(blocks)] + [VisionPoint("merger", tower.mm_projector, True)]
    mergers = list(getattr(tower, "deepstack_merger_list", None) or [])
    deep = getattr(tower, "deepstack_visual_indexes", None)
    if deep is None:
        deep = getattr(getattr(tower, "cfg", None), "deepstack_visual_indexes", ())
    after = dict(zip(list(deep)[:len(mergers)], range(len(mergers))))
    points = []
    for i, block in enumerate(tower.blocks):
        points.append(VisionPoint(f"v{i}", block, False))
        if i in after:
            points.append(VisionPoint(f"ds{after[i]}", mergers[after[i]], True))
    return points + [VisionPoint("merger", tower.merger, True)]


def _side_by_side(module) -> bool:
    return all(isinstance(getattr(module, n, None), torch.nn.Module) for n in ("vision_tower", "mm_projector"))


def hf_tower(model) -> torch.nn.Module | None:
    """transformers' vision model: ``model.visual`` or ``model.model.visual``, or the module holding a tower and
    its projector side by side (Kimi-K2.5's ``model.model``)."""
    for holder in (model, getattr(model, "model", None)):
        tower = getattr(holder, "visual", None)
        if isinstance(tower, torch.nn.Module):
            return tower
        if holder is not None and _side_by_side(holder):
            return holder
    return None


class Recorder:
    """Forward hooks on every vision point: each call's outputs (fp32, on the CPU), in call order."""

    def __init__(self, points: list[VisionPoint]):
        self.points = points
        self.calls: list[list[torch.Tensor]] = [[] for _ in points]
        self.handles = [p.module.register_forward_hook(self._hook(j)) for j, p in enumerate(points)]

    def _hook(self, j: int):
        def hook(_module, _args, out):
            out = out[0] if isinstance(out, (tuple, list)) else out
            # rows of the layer's width ([M, 1, D] from transformers' Kimi projector, [M, D] from ours)
            self.calls[j].append(out.detach().float().cpu().reshape(-1, out.shape[-1]))
        return hook

    def clear(self) -> None:
        self.calls = [[] for _ in self.points]

    def take(self) -> list[torch.Tensor]:
        """Each point's rows over the calls since the last ``take``."""
        out = [torch.cat(c) if c else torch.zeros(0) for c in self.calls]
        self.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
