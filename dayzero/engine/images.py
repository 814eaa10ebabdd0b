"""Images through the engine: a request's images checked, preprocessed and spliced into its prompt, and each
step's image inputs to the model (the tower's features of the placeholder rows, multimodal RoPE positions).

In a step, every image whose placeholder tokens some scheduled chunk covers must have its features: those
the encoder cache lacks are encoded together, in tower calls over the packed images of at most the largest
image's patch rows each, so a call's memory is bounded and counted (all of a sequence's
remaining images are taken when it is first scheduled, so a prompt's images are encoded in one call). A
sequence holds an image's entry until its tokens are all computed; a preempted sequence keeps holding what
it still needs, and takes it from the cache when it is prefilled again.

Multimodal RoPE: a sequence with images has positions that are not its token indices (``SeqImages.rope``,
then ``index + rope_delta``). A step whose chunks cover prompt positions of such a sequence gets
``rope_positions`` [3, T] and runs eagerly; past the prompt the three axes are equal, so decode steps take the
runner's 1-D rope positions (``index + rope_delta``, a step buffer that captured decode graphs read too).
"""
from __future__ import annotations

import torch

from dayzero.engine.host_copy import to_device
from dayzero.multimodal.costs import max_image_rows
from dayzero.multimodal.encoder_cache import EncoderCache
from dayzero.multimodal.families import VisionFamily
from dayzero.multimodal.inputs import ImageItem, SeqImages, StepImages, expand_placeholders, image_key
from dayzero.multimodal.mrope import mrope_positions


class ImageRunner:
    def __init__(self, family: VisionFamily, tower: torch.nn.Module, processor, raw: dict, device: torch.device,
                 dtype: torch.dtype, cache_tokens: int):
        self.family, self.tower, self.processor = family, tower, processor
        self.max_call_rows = max_image_rows(processor)  # a call's activations stay within the memory plan's
        self.image_token_id = family.image_token_id(raw)
        self.merge = family.merge(raw)
        self.device, self.dtype = device, dtype
        self.cache = EncoderCache(cache_tokens)
        self.num_calls = 0  # tower calls

    # --- requests -----------------------------------------------------------------------------------
    def prepare(self, ids: list[int], images: list) -> tuple[list[int], SeqImages | None]:
        """The prompt with each placeholder widened to its image's tokens, and the images; ValueError for a
        placeholder count that is not the image count, or an image that cannot be read."""
        found = sum(t == self.image_token_id for t in ids)
        if found != len(images):
            raise ValueError(f"prompt has {found} image placeholder token(s) (id {self.image_token_id}) but "
                             f"{len(images)} image(s) were given: put exactly one placeholder per image, in order")
        if not images:
            return ids, None
        inputs = self.processor(images)
        ids, starts = expand_placeholders(ids, self.image_token_id, inputs.num_tokens)
        items, row = [], 0
        for start, n, grid in zip(starts, inputs.num_tokens, inputs.grid_thw.tolist()):
            grid = tuple(int(g) for g in grid)
            rows = grid[0] * grid[1] * grid[2]
            px = inputs.pixel_values[row:row + rows]
            items.append(ImageItem(image_key(px, grid), px, grid, start, n))
            row += rows
        rope, delta = None, 0
        if self.family.mrope:
            rope, delta = mrope_positions(len(ids), [(it.start, it.grid) for it in items], self.merge)
        return ids, SeqImages(tuple(items), rope, delta)

    # --- steps --------------------------------------------------------------------------------------
    def step_inputs(self, scheduled) -> tuple[StepImages | None, torch.Tensor | None]:
        """(image rows of the step, or None; [3, T] multimodal RoPE positions, or None)."""
        if all(s.seq.images is None for s in scheduled):
            return None, None
        self._encode(scheduled)
        rows, feats, deep, pos, any_rope, q0 = [], [], [], [], False, 0
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            a, b, mm = seq.num_computed, seq.num_computed + n, seq.images
            if mm is not None:
                for it, lo, hi in mm.overlapping(a, b):
                    e = self.cache.take(seq.seq_id, it.key)
                    rows += range(q0 + it.start + lo - a, q0 + it.start + hi - a)
                    feats.append(e.features[lo:hi])
                    deep.append([d[lo:hi] for d in e.deepstack])
            if self.family.mrope:
                if mm is not None and mm.rope is not None:
                    pos.append(mm.rope_positions(a, b))
                    any_rope |= a < mm.rope.shape[1]  # past its prompt the runner's 1-D rope positions serve
                else:
                    pos.append(torch.arange(a, b, dtype=torch.int64).expand(3, -1))
            q0 += n
        images = None
        if rows:
            images = StepImages(to_device(rows, torch.int64, self.device), torch.cat(feats),
                                [torch.cat(layer) for layer in zip(*deep)])
        rope = torch.cat(pos, dim=1).to(self.device) if any_rope else None
        return images, rope

    def _encode(self, scheduled) -> None:
        """Tower calls over the images the step's sequences need and the cache lacks: one call, unless their patch
        rows exceed what one call may take (the largest image's, :func:`~dayzero.multimodal.costs.max_image_rows`)."""
        todo: dict[bytes, tuple[ImageItem, set[int]]] = {}
        for s in scheduled:
            mm, seq = s.seq.images, s.seq
            if mm is None:
                continue
            for it in mm.items:
                if it.end > seq.num_computed and it.key not in self.cache:
                    todo.setdefault(it.key, (it, set()))[1].add(seq.seq_id)
        calls, rows = [[]], 0  # images packed into calls of at most max_call_rows patch rows (one image at least)
        for key, (it, holders) in todo.items():
            n = it.pixel_values.shape[0]
            if calls[-1] and rows + n > self.max_call_rows:
                calls, rows = calls + [[]], 0
            calls[-1].append((key, it, holders))
            rows += n
        for call in calls if todo else ():
            self._encode_call(call)

    def _encode_call(self, call: list[tuple[bytes, ImageItem, set[int]]]) -> None:
        px = torch.cat([it.pixel_values for _, it, _ in call]).to(self.device, self.dtype)
        grid = torch.tensor([it.grid for _, it, _ in call], dtype=torch.int64)
        with torch.inference_mode():
            out = self.tower(px, grid)
        self.num_calls += 1
        sizes = [it.num_tokens for _, it, _ in call]
        feats = out.features.split(sizes)
        deep = [d.split(sizes) for d in out.deepstack]
        for j, (key, _, holders) in enumerate(call):
            self.cache.put(key, feats[j], [d[j] for d in deep], holders)

    def after_step(self, scheduled) -> None:
        """Sequences let go of the images whose tokens they have all computed (or that they no longer need)."""
        for s in scheduled:
            if s.seq.images is not None:
                self.release(s.seq, upto=None if s.seq.finished else s.seq.num_computed)

    def release(self, seq, upto: int | None = None) -> None:
        """``seq`` lets go of its images ending at or before ``upto`` (None: all of them)."""
        for it in seq.images.items if seq.images is not None else ():
            if upto is None or it.end <= upto:
                self.cache.drop(seq.seq_id, it.key)

    def reset_cache(self) -> None:
        """Forget every encoded image: the next steps encode their images afresh (the align and profile tools
        run each prompt's images through the tower)."""
        self.cache = EncoderCache(self.cache.capacity)

    def stats(self) -> dict:
        return {"encoder_runs": self.cache.num_encoded, "encoder_cache_hits": self.cache.num_hits,
                "encoder_calls": self.num_calls}
