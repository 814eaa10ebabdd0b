"""What the vision encoder holds beside its weights, for the engine's memory budget and ``dayzero plan``.

One tower call takes at most :func:`max_image_rows` patch rows (the largest image the processor makes; smaller
images are packed into a call up to that many rows, a larger one is never made), so the call's activations
are bounded whatever a step brings. Its output features stay in the encoder cache, which keeps up to
``cache_rows`` feature rows of images nobody holds any more (plus those still held).
"""
from __future__ import annotations

from torch import nn

# the encoder cache's rows of unheld features: 4 prefill steps' worth of tokens, at least 16,384
CACHE_STEPS, CACHE_MIN_ROWS = 4, 16384


def cache_rows(max_num_batched_tokens: int) -> int:
    return max(CACHE_STEPS * max_num_batched_tokens, CACHE_MIN_ROWS)


def max_image_rows(processor) -> int:
    """Patch rows of the largest image ``processor`` makes (rows of all its frames)."""
    if hasattr(processor, "max_patches"):  # NaViT resize to at most max_patches, then padded to whole windows
        m = processor.merge_size
        return processor.max_patches + 2 * m * processor.max_patches_per_side + m * m
    # smart resize keeps h * w <= max_pixels; a still image is one temporal patch
    return processor.max_pixels // processor.patch_size**2


def _dims(tower: nn.Module) -> tuple[int, int, int, int, int]:
    """(width, MLP width, heads' width, text width of a feature, feature tensors per image) of a tower."""
    cfg = tower.cfg if hasattr(tower, "cfg") else tower.vision_tower.cfg  # Kimi: tower + projector
    width, inter = cfg.hidden_size, cfg.intermediate_size
    out = getattr(cfg, "out_hidden_size", None) or getattr(cfg, "text_hidden_size")
    heads = getattr(cfg, "num_heads", None) or getattr(cfg, "num_attention_heads")
    return width, inter, width // heads, out, 1 + len(getattr(cfg, "deepstack_visual_indexes", ()))


def call_bytes(tower: nn.Module, rows: int, act_bytes: int) -> int:
    """Activations of one tower call over ``rows`` patch rows: the residual, the norm's output, q/k/v, the
    attention output and the MLP's hidden rows of a block, fp32 rotary tables, the merged features."""
    width, inter, head_dim, out, feats = _dims(tower)
    merge = 4  # 2 x 2 windows per output row in every family here
    return rows * ((6 * width + inter) * act_bytes + 2 * head_dim * 4) + rows // merge * out * feats * act_bytes


def cache_bytes(tower: nn.Module, rows: int, act_bytes: int) -> int:
    """The encoder cache's features (and deep-stack features) for ``rows`` output rows."""
    _, _, _, out, feats = _dims(tower)
    return rows * out * feats * act_bytes


def encoder_bytes(tower: nn.Module, processor, max_num_batched_tokens: int, act_bytes: int) -> int:
    """Transient bytes the encoder may hold at once: one call of the largest image and a full cache."""
    return (call_bytes(tower, max_image_rows(processor), act_bytes)
            + cache_bytes(tower, cache_rows(max_num_batched_tokens), act_bytes))
