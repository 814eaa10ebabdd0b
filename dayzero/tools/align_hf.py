"""The transformers reference for ``dayzero align``: the checkpoint loaded by transformers' own class for its
``model_type``, in fp32 on the CPU.

``hidden_states[i + 1]`` of ``output_hidden_states=True`` is the residual stream after layer ``i``, except the
last entry: transformers replaces it with the final norm's output. The residual stream after the last layer is
taken from the input of the final norm instead (a pre-hook), or, in models with hyper-connections, from the
input of the head that collapses the streams (``hc_head``) before that norm; a model whose norm cannot be
found compares the last layer after the final norm on both sides, and says so in the row.

With images the model is transformers' vision-language class (``AutoModelForImageTextToText``), given the
widened prompt, the processor's pixel rows and grids; forward hooks on its tower's layers (``model.visual`` or
``model.model.visual``; Kimi-K2.5's ``model.model.vision_tower.layers`` and ``mm_projector``) record each vision
layer's output.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from dayzero.models.registry import read_config
from dayzero.tools.align_capture import Capture, capture_each, release_memory
from dayzero.tools.progress import note

# transformers takes these kernels whenever they import, without a device check: the reference must run
# its pure-PyTorch path
KERNEL_MODULES = ("fla", "fla.ops", "fla.modules", "causal_conv1d", "mamba_ssm", "flash_attn", "kernels")
NORM_NAMES = ("hc_head", "norm", "final_layernorm", "ln_f", "norm_f")  # hc_head: the streams' collapse


def hf_knows(path: str | Path) -> bool:
    """Whether transformers is installed and has an implementation of the checkpoint's model_type."""
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except ImportError:
        return False
    raw, _ = read_config(path)
    return raw.get("model_type") in CONFIG_MAPPING


def block_kernels() -> None:
    """transformers as a reference: its pure-PyTorch path, with no kernel package imported and no hub kernels
    (from transformers 5.25, ``from_pretrained`` takes hub kernels unless ``USE_HUB_KERNELS`` says no, and fails
    when the ``kernels`` package cannot import)."""
    os.environ["USE_HUB_KERNELS"] = "NO"
    for name in KERNEL_MODULES:
        if sys.modules.get(name) is None:
            sys.modules[name] = None  # the import fails: transformers falls back to torch


def final_norm(model) -> torch.nn.Module | None:
    """The module whose input is the residual stream after the last layer (the final norm, or hc_head)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    for holder in (base, getattr(base, "language_model", None)):  # a vision-language model's text model
        for name in NORM_NAMES:
            norm = getattr(holder, name, None)
            if isinstance(norm, torch.nn.Module):
                return norm
    return None


@torch.inference_mode()
def capture_hf(path: str | Path, prompts: list, num_layers: int, progress: bool = False) -> list[Capture]:
    """Every prompt through transformers (fewer captures when interrupted, see ``capture_each``). A prompt is
    its token ids, or a :class:`~dayzero.tools.align_images.PromptInputs` (widened ids and pixel rows)."""
    block_kernels()
    import transformers

    from dayzero.tools.align_images import PromptInputs, Recorder, hf_tower, vision_points

    vision = any(isinstance(p, PromptInputs) and p.images for p in prompts)
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    if progress:
        note(f"align: loading the transformers reference (fp32 on cpu) from {path}")
    model = auto.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    seen: dict[str, torch.Tensor] = {}
    rec = None
    if vision:
        tower = hf_tower(model)
        if tower is None:
            raise ValueError(f"transformers' {type(model).__name__} has no vision model (model.visual, model.model.visual "
                             "or model.model.vision_tower with mm_projector)")
        rec = Recorder(vision_points(tower))

    def pre_norm(_module, args, kwargs):
        seen["x"] = args[0] if args else next(iter(kwargs.values()))

    def run_one(prompt) -> Capture:
        seen.clear()
        kwargs = {}
        if isinstance(prompt, PromptInputs):
            ids = prompt.wide
            if prompt.images:
                image_token = model.config.image_token_id
                kwargs = dict(pixel_values=prompt.pixel_values, image_grid_thw=prompt.grid_thw,
                              mm_token_type_ids=(torch.tensor([ids]) == image_token).int())
        else:
            ids = prompt
        if rec is not None:
            rec.clear()
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False, **kwargs)
        hs = out.hidden_states
        if hs is None or len(hs) != num_layers + 1:
            got = "none" if hs is None else len(hs) - 1
            raise ValueError(f"transformers' {type(model).__name__} gave hidden states of {got} layers, dayzero has {num_layers}")
        layers = [h[0].float() for h in hs[1:]]  # [T, D] each
        notes = {}
        if "x" in seen:
            layers[-1] = seen["x"][0].float()
        else:
            notes[num_layers - 1] = "after final norm"
        shown = rec.take() if rec is not None and kwargs else []
        return Capture(layers, None, out.logits[0].float(), notes, shown)

    norm = final_norm(model)
    handle = norm.register_forward_pre_hook(pre_norm, with_kwargs=True) if norm is not None else None
    try:
        return capture_each(run_one, prompts, "transformers reference", progress)
    finally:
        if handle is not None:
            handle.remove()
        if rec is not None:
            rec.remove()
        del model
        release_memory()
