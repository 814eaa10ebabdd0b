"""The transformers reference for ``dayzero align``: the checkpoint loaded by transformers' own class for its
``model_type``, in fp32 on the CPU.

``hidden_states[i + 1]`` of ``output_hidden_states=True`` is the residual stream after layer ``i``, except the
last entry: transformers replaces it with the final norm's output. The residual stream after the last layer is
taken from the input of the final norm instead (a pre-hook), or, in models with hyper-connections, from the
input of the head that collapses the streams (``hc_head``) before that norm; a model whose norm cannot be
found compares the last layer after the final norm on both sides, and says so in the row.
"""
from __future__ import annotations

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
    for name in KERNEL_MODULES:
        if sys.modules.get(name) is None:
            sys.modules[name] = None  # the import fails: transformers falls back to torch


def final_norm(model) -> torch.nn.Module | None:
    """The module whose input is the residual stream after the last layer (the final norm, or hc_head)."""
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    for name in NORM_NAMES:
        norm = getattr(base, name, None)
        if isinstance(norm, torch.nn.Module):
            return norm
    return None


@torch.inference_mode()
def capture_hf(path: str | Path, prompts: list[list[int]], num_layers: int, progress: bool = False) -> list[Capture]:
    """Every prompt through transformers (fewer captures when interrupted, see ``capture_each``)."""
    block_kernels()
    from transformers import AutoModelForCausalLM

    if progress:
        note(f"align: loading the transformers reference (fp32 on cpu) from {path}")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    seen: dict[str, torch.Tensor] = {}

    def pre_norm(_module, args, kwargs):
        seen["x"] = args[0] if args else next(iter(kwargs.values()))

    def run_one(ids: list[int]) -> Capture:
        seen.clear()
        out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
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
        return Capture(layers, None, out.logits[0].float(), notes)

    norm = final_norm(model)
    handle = norm.register_forward_pre_hook(pre_norm, with_kwargs=True) if norm is not None else None
    try:
        return capture_each(run_one, prompts, "transformers reference", progress)
    finally:
        if handle is not None:
            handle.remove()
        del model
        release_memory()
