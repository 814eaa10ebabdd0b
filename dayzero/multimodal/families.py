"""Vision-language families by ``model_type``: how to build the tower from ``config.json``, how to configure the
image processor, which checkpoint tensors the tower holds and how they map onto it, the image placeholder
token, and whether the text model takes multimodal RoPE positions.

The tower is attached to the text model as ``visual`` (see :func:`attach_tower`), so one loader pass fills
both from the checkpoint and ends with nothing missing or left over. The adapters keep the tower's tensors
in their ``ignore`` list for the tools that build the text model alone; the engine loads them instead
(:meth:`VisionFamily.text_ignore`). A config whose tower cannot take images (``VisionFamily.problem``) loads as
its text model alone, with a warning, and its requests with images are refused.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from torch import nn

from dayzero.loader.rules import Rule
from dayzero.multimodal.kimi_k25 import KimiK25Vision, KimiK25VisionConfig, checkpoint_rules
from dayzero.multimodal.processors import KimiK25ImageProcessor, Qwen3VLImageProcessor
from dayzero.multimodal.qwen3_vl import Qwen3VLVision, Qwen3VLVisionConfig

PREPROCESSOR_FILE = "preprocessor_config.json"
log = logging.getLogger("dayzero.multimodal")


def _no_problem(raw: dict) -> str | None:
    return None


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
    problem: Callable[[dict], str | None] = _no_problem  # why config.json's tower cannot take images; None: it can

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


def _kimi_processor(raw: dict, pre: dict):
    vc = raw.get("vision_config") or {}
    base = {k: vc[s] for k, s in (("patch_size", "patch_size"), ("merge_size", "merge_kernel_size")) if s in vc}
    return KimiK25ImageProcessor.from_config({**base, **pre})


def _kimi_problem(raw: dict) -> str | None:
    try:
        KimiK25VisionConfig.from_hf(raw)
    except ValueError as e:  # e.g. transformers' default projection_hidden_size=1152 beside a narrower tower
        return str(e)
    return None


# the release's names and transformers' save (see kimi_k25.py); what the deepseek adapter's kimi_k25 ignores
KIMI_TENSORS = (r"vision_tower\..*", r"(?:model\.)?mm_projector\..*")

FAMILIES = {f.model_type: f for f in (
    VisionFamily("qwen3_5_moe", (QWEN_VISUAL,), lambda raw: Qwen3VLVision(Qwen3VLVisionConfig.from_hf(raw)),
                 _qwen_processor, _qwen_rules, 248056, True,
                 lambda raw: int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))),
    VisionFamily("qwen3_vl_moe", (QWEN_VISUAL,), lambda raw: Qwen3VLVision(Qwen3VLVisionConfig.from_hf(raw)),
                 _qwen_processor, _qwen_rules, 151655, True,
                 lambda raw: int((raw.get("vision_config") or {}).get("spatial_merge_size", 2))),
    # 163605: <|media_pad|>, the release's media_placeholder_token_id; plain 1-D positions
    VisionFamily("kimi_k25", KIMI_TENSORS, lambda raw: KimiK25Vision(KimiK25VisionConfig.from_hf(raw)),
                 _kimi_processor, lambda raw: checkpoint_rules(KimiK25VisionConfig.from_hf(raw), "visual."),
                 163605, False, lambda raw: KimiK25VisionConfig.from_hf(raw).merge_kernel_size[0], _kimi_problem),
)}


def tower_problem(raw: dict) -> str | None:
    """Why a vision-language ``config.json``'s tower cannot take images, or None (also for text-only configs)."""
    fam = FAMILIES.get(raw.get("model_type"))
    return None if fam is None or raw.get("vision_config") is None else fam.problem(raw)


def vision_family(raw: dict) -> VisionFamily | None:
    """The family of a vision-language ``config.json`` with a ``vision_config``; None for a text-only one, or
    one whose tower cannot take images (logged)."""
    fam = FAMILIES.get(raw.get("model_type"))
    if fam is None or raw.get("vision_config") is None:
        return None
    problem = fam.problem(raw)
    if problem is not None:
        log.warning("%s: %s; the text model loads alone and images are refused", fam.model_type, problem)
        return None
    return fam


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

