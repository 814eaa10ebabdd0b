"""One side of an alignment: the residual stream after every decoder layer, the final norm's output and the
logits of each prompt, fp32 on the CPU, and with images every vision layer's output. Our side runs each
prompt through the engine's runner as one prefill chunk with a forward hook on every layer (its images
encoded by the tower in that step, hooked too); :mod:`dayzero.tools.align_hf` is transformers' side."""
from __future__ import annotations

import gc
from dataclasses import dataclass, field

import torch

from dayzero.tools.progress import bar, note


@dataclass
class Capture:
    """One prompt's outputs on one side, fp32 on the CPU."""

    layers: list[torch.Tensor]  # residual stream after each layer, each [T, D]
    final: torch.Tensor | None  # after the final norm [T, D]
    logits: torch.Tensor  # [T, vocab]
    notes: dict[int, str] = field(default_factory=dict)  # layer -> why its reference is not the plain residual
    vision: list[torch.Tensor] = field(default_factory=list)  # each vision point's rows over the prompt's images


def engine_kwargs(dtype: str, device: str, precision: dict, longest: int, **extra) -> dict:
    # one sequence at a time: a cache of one prompt's length is enough; the precision config wins
    return {"device": device, "dtype": dtype, "max_num_seqs": 1, "max_model_len": longest + 1,
            "max_num_batched_tokens": max(2048, longest), **extra, **precision}


def check_precision(precision: dict) -> None:
    """Every key of a precision config is an ``LLM`` keyword argument."""
    import inspect

    from dayzero import LLM

    allowed = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    bad = sorted(set(precision) - allowed)
    if bad:
        raise ValueError(f"precision config: {', '.join(bad)} {'is no' if len(bad) == 1 else 'are no'} LLM keyword "
                         f"argument{'s' * (len(bad) > 1)}; LLM takes {', '.join(sorted(allowed))}")


@torch.inference_mode()
def run_engine(engine, ids: list[int], images: list | None = None) -> Capture:
    """Push one prompt (with its ``images``, one placeholder token each) through ``engine``'s runner as one
    prefill chunk, recording every layer's output and, with images, every vision layer's."""
    from dayzero.engine.request import Sequence
    from dayzero.engine.sampling_params import SamplingParams
    from dayzero.engine.scheduler import ScheduledSeq
    from dayzero.tools.align_images import Recorder, vision_points

    layers = engine.model.model.layers
    outs: list[torch.Tensor | None] = [None] * len(layers)

    def record(i):
        def hook(_module, _args, out):
            x, residual = out
            # the residual stream after layer i, summed in fp32 before the next layer's rounding
            outs[i] = (x.float() if residual is None else x.float() + residual.float()).cpu()
        return hook

    mm, rec = None, None
    if images:
        if engine.images is None:
            raise ValueError(f"model {engine.model_config.model_type!r} does not take images")
        ids, mm = engine.images.prepare(list(ids), list(images))
        # every prompt's images go through the tower, none from the cache of an earlier prompt
        engine.images.reset_cache()
        rec = Recorder(vision_points(engine.images.tower))
    handles = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    seq = Sequence("align", 0, list(ids), len(ids), SamplingParams(), images=mm)
    try:
        if not engine.cache.grow(seq.seq_id, len(ids)):
            raise RuntimeError(f"the cache cannot hold a prompt of {len(ids)} tokens")
        step = [ScheduledSeq(seq, len(ids))]
        img, rope = engine.images.step_inputs(step) if mm is not None else (None, None)
        batch = engine.runner.build_batch(step, engine.cache, eager=mm is not None)
        batch.images, batch.rope_positions = img, rope
        hidden = engine.model(batch)  # [T, D] after the final norm
        logits = engine.model.compute_logits(hidden)
        vision = _in_prompt_order(rec, mm) if rec is not None else []
    finally:
        for h in handles:
            h.remove()
        if rec is not None:
            rec.remove()
        engine.cache.release(seq.seq_id)
        if mm is not None:
            engine.images.release(seq)
    return Capture(outs, hidden.float().cpu(), logits.float().cpu(), vision=vision)


def _in_prompt_order(rec, mm) -> list[torch.Tensor]:
    """Each vision point's rows image by image in prompt order, as transformers computes them: the engine
    encodes an image that the prompt holds twice once, in the order of first appearance."""
    first = list({it.key: it for it in mm.items}.values())
    out = []
    for p, rows in zip(rec.points, rec.take()):
        sizes = [it.num_tokens if p.merged else it.pixel_values.shape[0] for it in first]
        if rows.shape[0] != sum(sizes):
            raise RuntimeError(f"vision layer {p.name}: {rows.shape[0]} rows recorded, the images have {sum(sizes)}")
        by_key = dict(zip((it.key for it in first), rows.split(sizes)))
        out.append(torch.cat([by_key[it.key] for it in mm.items]))
    return out


def capture_each(run_one, prompts: list, desc: str, progress: bool) -> list[Capture]:
    """``run_one(prompt)`` for each prompt, with a progress bar. Ctrl-C stops it: the captures of the prompts
    done so far come back, fewer than the prompts, and the caller decides what that means."""
    caps: list[Capture] = []
    pbar = bar(len(prompts), desc, progress, unit="prompt")
    try:
        for p in prompts:
            caps.append(run_one(p))
            pbar.update()
    except KeyboardInterrupt:
        pass
    finally:
        pbar.close()
    return caps


def capture_dayzero(model: str, prompts: list[list[int]], desc: str = "", progress: bool = False,
                    images: list[list] | None = None, **llm_kwargs) -> tuple[list[Capture], object, str]:
    """Load ``model`` with dayzero (``llm_kwargs`` go to ``LLM``), run every prompt (with ``images[i]``, its
    images): the captures (fewer when interrupted), the model spec and the device it ran on."""
    from dayzero import LLM

    if progress:
        note(f"align: loading the {desc} from {model}")
    llm = LLM(model, **llm_kwargs)
    if progress:
        note(f"align: running the {desc} ({str(llm.engine.dtype).removeprefix('torch.')} on {llm.engine.device})")
    try:
        pairs = list(zip(prompts, images or [[] for _ in prompts]))
        caps = capture_each(lambda p: run_engine(llm.engine, *p), pairs, desc, progress)
        spec, dev = llm.engine.model_config, str(llm.engine.device)
    finally:
        del llm  # the next side loads into the memory this one held
        release_memory()
    return caps, spec, dev


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
