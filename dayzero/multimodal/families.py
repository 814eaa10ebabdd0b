"""Vision-language families by ``model_type``: how to build the tower from ``config.json``, how to configure the
image processor, which checkpoint tensors the tower holds and how they map onto it, the image placeholder
token, and whether the text model takes multimodal RoPE positions.

The tower is attached to the text model as ``visual`` (see :func:`attach_tower`), so one loader pass fills
both from the checkpoint and ends with nothing missing or left over. The adapters keep the tower's tensors
in their ``ignore`` list for the tools that build the text model alone; the engine loads them instead
(:meth:`VisionFamily.text_ignore`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from dayzero.loader.rules import Rule
from dayzero.multimodal.processors import Qwen3VLImageProcessor
from dayzero.multimodal.qwen3_vl import Qwen3VLVision, Qwen3VLVisionConfig

PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class VisionFamily:
    model_type: str
    tensors: tuple[str, ...]  # checkpoint name patterns of the tower (as the adapter's ignore spells them)
    build: Callable[[dict], nn.Module]  # config.json -> tower
    processor: Callable[[dict, dict], object]  # (config.json, preprocessor_config.json or {}) -> processor
    rules: Callable[[dict], list[Rule]]  # checkpoint names -> ``visual.*`` parameters
    default_image_token: int
    mrope: bool  # the text model takes (t, h, w) positions
    merge: Callable[[dict], int]  # patches per merged token along each side

    def image_token_id(self, raw: dict) -> int:
        return int(raw.get("image_token_id", raw.get("media_placeholder_token_id", self.default_image_token)))

    def text_ignore(self, ignore: tuple[str, ...]) -> tuple[str, ...]:
        """An adapter's ignore list without the tower's tensors (they load into the tower)."""
        return tuple(p for p in ignore if p not in self.tensors)


def _qwen_processor(raw: dict, pre: dict):
    vc = raw.get("vision_config") or {}
    base = {k: vc[s] for k, s in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                                  ("merge_size", "spatial_merge_size")) if s in vc}
    return Qwen3VLImageProcessor.from_config({**base, **pre})


QWEN_VISUAL = r"model\.visual\..*"


def _qwen_rules(raw: dict) -> list[Rule]:
    return [Rule(r"model\.visual\.(.+)", "visual.{0}")]


FAMILIES = {f.model_type: f for f in (
    VisionFamily("qwen3_5_moe", (QWEN_VISUAL,), lambda raw: Qwen3VLVision(Qwen3VLVisionConfig.from_hf(raw)),
                 _qwen_processor, _qwen_rules, 248056, True,
                 lambda raw: int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))),
    VisionFamily("qwen3_vl_moe", (QWEN_VISUAL,), lambda raw: Qwen3VLVision(Qwen3VLVisionConfig.from_hf(raw)),
                 _qwen_processor, _qwen_rules, 151655, True,
                 lambda raw: int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))),
)}


def vision_family(raw: dict) -> VisionFamily | None:
    """The family of a vision-language ``config.json`` with a ``vision_config``; None for a text-only one."""
    fam = FAMILIES.get(raw.get("model_type"))
    return fam if fam is not None and raw.get("vision_config") is not None else None


def read_preprocessor_config(path: Path) -> dict:
    file = Path(path) / PREPROCESSOR_FILE
    if not file.exists():
        return {}
    with open(file) as f:
        return json.load(f)


def attach_tower(model: nn.Module, family: VisionFamily, raw: dict) -> nn.Module:
    """Build the tower (on the current default device and dtype) as ``model.visual``; returns it."""
    model.visual = family.build(raw).eval()
    return model.visual

