"""Tiny random vision-language checkpoints made by transformers' own classes, and transformers' image-aware
references: prompt logits of a no-cache forward with the same pixel rows, and greedy tokens by a full forward
per token."""
from __future__ import annotations

import json

import numpy as np
import torch
from PIL import Image

from dayzero.engine.request import Sequence
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.scheduler import ScheduledSeq
from tests.hf.harness import make_hf_checkpoint
from tests.hf.test_vl_text_families import FAMILIES as TEXT_FAMILIES, TEXT, slow_decay

IMAGE_TOKEN = 299  # the last id of the tiny vocabulary, never in a random text prompt (see text_ids)
VISION_START, VISION_END = 297, 298
# a small pixel budget keeps the Qwen towers' grids small (patch 16, merge 2: 32-pixel cells); Kimi's processor
# reads none of it (its 28-pixel cells stay far under its patch budget)
PREPROCESSOR = {"size": {"shortest_edge": 32 * 32, "longest_edge": 32 * 32 * 12}}


def config(model_type: str) -> dict:
    cfg = TEXT_FAMILIES[model_type]
    extra = {}
    if model_type == "kimi_k25":  # transformers' default 1152 is the release tower's width, not the tiny one's
        extra["projection_hidden_size"] = cfg["vision_config"]["hidden_size"]
    return {**cfg, "text_config": {**TEXT, **cfg["text_config"]}, "image_token_id": IMAGE_TOKEN,
            "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END, **extra}


@torch.no_grad()
def sharp_vision_attention(model, scale: float = 8.0) -> None:
    """Kimi's tower: q and k weights ``scale`` times their init (std 0.02), so attention scores are of order one
    and the rotary (hence the q/k row order) shows in the outputs; near-uniform attention would hide it."""
    for layer in model.model.vision_tower.layers:
        layer.attn.q_proj.weight.mul_(scale)
        layer.attn.k_proj.weight.mul_(scale)


INIT = {"qwen3_5_moe": slow_decay, "kimi_k25": sharp_vision_attention}


def make_checkpoint(path, model_type: str):
    """The checkpoint at ``path`` (with a preprocessor config) and transformers' model of it (fp32)."""
    hf = make_hf_checkpoint(path, model_type, init=INIT.get(model_type), auto_class="AutoModelForImageTextToText",
                            **config(model_type))
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return hf


def noise_image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def text_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VISION_START, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def image_prompt(parts) -> list[int]:
    """Token ids of text runs (ints: that many random tokens) and images ("img": one placeholder)."""
    out = []
    for j, p in enumerate(parts):
        out += [VISION_START, IMAGE_TOKEN, VISION_END] if p == "img" else text_ids(p, seed=100 + j)
    return out


@torch.no_grad()
def hf_logits(hf, ids: list[int], images) -> torch.Tensor:
    """transformers' no-cache forward over the expanded prompt ``ids`` with the processor's pixel rows."""
    x = torch.tensor([ids])
    kwargs = {}
    if images is not None:
        kwargs = dict(pixel_values=images.pixel_values, image_grid_thw=images.grid_thw,
                      mm_token_type_ids=(x == IMAGE_TOKEN).int())
    return hf(input_ids=x, **kwargs).logits[0].float()


@torch.no_grad()
def hf_greedy(hf, ids: list[int], images, n: int, tie: float = 1e-4) -> list[int]:
    """Up to ``n`` greedy tokens, one full forward (no cache) each; stops after a step whose top-2 gap is
    under ``tie`` (rounding may pick either) or before a token that is the image placeholder (transformers
    would read it as an image)."""
    out = list(ids)
    for _ in range(n):
        top = hf_logits(hf, out, images)[-1].topk(2)
        tok = int(top.indices[0])
        if tok == IMAGE_TOKEN:
            break
        out.append(tok)
        if (top.values[0] - top.values[1]).item() < tie:
            break
    return out[len(ids):]


@torch.no_grad()
def engine_logits(engine, prompts, chunk: int | list[int]) -> list[torch.Tensor]:
    """Every row's logits of each (ids, images) prompt, all fed through the engine's runner together, each
    sequence taking up to ``chunk`` tokens a step (or the sizes of a list, one per step, for one prompt)."""
    seqs = []
    for ids, images in prompts:
        wide, mm = engine.prepare_prompt(list(ids), images)
        seqs.append(Sequence("t", 0, list(wide), len(wide), SamplingParams(), images=mm))
    rows = [[] for _ in seqs]
    sizes = iter(chunk) if isinstance(chunk, list) else None
    while any(q.num_computed < q.num_tokens for q in seqs):
        c = next(sizes) if sizes is not None else chunk
        step = [ScheduledSeq(q, min(c, q.num_tokens - q.num_computed)) for q in seqs if q.num_computed < q.num_tokens]
        for s in step:
            assert engine.cache.grow(s.seq.seq_id, s.seq.num_computed + s.num_tokens)
        img, rope = engine.images.step_inputs(step)
        batch = engine.runner.build_batch(step, engine.cache, eager=True)
        batch.images, batch.rope_positions = img, rope
        logits = engine.model.compute_logits(engine.model(batch))
        for s, part in zip(step, logits.split([s.num_tokens for s in step])):
            rows[seqs.index(s.seq)].append(part)
            s.seq.num_computed += s.num_tokens
        engine.images.after_step(step)
    for q in seqs:
        engine.cache.release(q.seq_id)
        engine.images.release(q)
    return [torch.cat(r) for r in rows]
