"""Models for training and the checkpoints they become.

:func:`new_model` builds a ``dayzero_hybrid`` model with the project's builder (``build_model``, the one the
engine uses) in fp32 and gives it its initial weights; :func:`load_model` loads a checkpoint the same way.
:func:`save_checkpoint` writes the layout of the bundled model (``dayzero/assets/default``): ``config.json``,
``model.safetensors`` (bf16; router, gate parameters and indexer weights in fp32), the tokenizer files and chat
template of the tokenizer's checkpoint, ``generation_config.json``. With ``expert_format="mxfp4"`` the routed
experts are stored as MXFP4 (``w1_blocks`` / ``w1_scales`` ..., OCP rounding of ``dayzero.quant.mxfp4``) and the
config says so, as ``dayzero quantize`` writes them.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from dayzero.config.model_config import HybridConfig
from dayzero.loader.safetensors_loader import load_weights
from dayzero.models.registry import adapter_for, build_model, read_config
from dayzero.quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from dayzero.tools.build_default_model import _is_high_precision
from dayzero.tools.safetensors_out import write_safetensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
EXPERT_FORMATS = ("mxfp4", "bf16")


def _dense(config: HybridConfig) -> HybridConfig:
    """The config with dense (trainable) experts whatever the checkpoint stores them as."""
    raw = config.to_dict()
    raw.pop("quantization_config", None)
    return HybridConfig.from_dict(raw)


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Initial weights for training: linears and experts N(0, 0.02) with the output projections scaled down by
    the depth (GPT-2), norms at one, KDA's decay parameters as fla initialises them, selection biases at zero."""
    g = torch.Generator().manual_seed(seed)
    layers = len(model.model.layers)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if not p.is_floating_point():  # tables (hash routing), not weights
            continue
        if leaf == "A_log":
            v = torch.log(torch.empty(p.shape).uniform_(1, 16, generator=g))
        elif leaf == "dt_bias":  # softplus^-1 of decay steps in [1e-3, 0.1], log-uniform
            dt = torch.exp(torch.rand(p.shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            v = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "e_score_correction_bias" or leaf == "bias":
            v = torch.zeros(p.shape)
        elif "norm" in name:
            v = torch.ones(p.shape)
        elif "conv1d" in name:
            v = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])
        else:
            std = 0.02 / math.sqrt(2 * layers) if leaf in ("w2",) or "o_proj" in name or "down_proj" in name \
                or "fc2_latent" in name else 0.02
            v = torch.randn(p.shape, generator=g) * std
        p.copy_(v.to(p.dtype))
    return model


def new_model(config: HybridConfig, device, seed: int = 0) -> torch.nn.Module:
    model = build_model(_dense(config).to_spec(), torch.float32, "cpu")
    return init_weights(model, seed).to(device).train()


def load_model(path: str | Path, device) -> torch.nn.Module:
    """A ``dayzero_hybrid`` checkpoint as an fp32 model for training, built and loaded as the engine builds and
    loads it; MXFP4 routed experts are dequantised into dense, trainable ones (a run that starts from a
    checkpoint, ``scripts/train_default.py --init``)."""
    raw, file = read_config(path)
    adapter = adapter_for(raw, file)
    spec = adapter.to_spec(raw)
    model = build_model(spec, torch.float32, "cpu")
    load_weights(model, Path(path), adapter.rules(spec), adapter.ignore)
    packed = model.state_dict()
    if not any(n.endswith("_blocks") for n in packed):
        return model.to(device).train()
    dense = build_model(_dense(HybridConfig.from_dict(raw)).to_spec(), torch.float32, "cpu")
    state = {}
    for name in dense.state_dict():
        if name in packed:
            state[name] = packed[name]
        else:  # an MXFP4 expert tensor: w1 from w1_blocks and w1_scales
            state[name] = dequantize_mxfp4(packed[name + "_blocks"], packed[name + "_scales"], torch.float32)
    dense.load_state_dict(state)
    return dense.to(device).train()


def checkpoint_tensors(model, config: HybridConfig, expert_format: str = "mxfp4") -> dict[str, torch.Tensor]:
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert format must be one of {', '.join(EXPERT_FORMATS)}, got {expert_format!r}")
    tensors = {}
    for name, p in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        p = p.detach().cpu()
        leaf = name.rsplit(".", 1)[-1]
        if expert_format == "mxfp4" and leaf in ("w1", "w2") and ".mlp." in name:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize_mxfp4(p.float())
            continue
        keep = p.dtype == torch.float32 and _is_high_precision(name)
        tensors[name] = (p if keep else p.to(torch.bfloat16)).contiguous()
    return tensors


def save_checkpoint(model, config: HybridConfig, out: str | Path, tokenizer_dir: str | Path,
                    expert_format: str = "mxfp4") -> Path:
    """Write the checkpoint into ``out`` (created; files already there are replaced)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = checkpoint_tensors(model, config, expert_format)
    tmp = out / "model.safetensors.tmp"
    write_safetensors(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    raw = _dense(config).to_dict()
    raw.pop("quantization_config", None)
    if expert_format == "mxfp4":
        raw["quantization_config"] = {"quant_method": "mxfp4"}
    raw["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    src = Path(tokenizer_dir)
    for f in TOKENIZER_FILES:
        if (src / f).exists():
            shutil.copy2(src / f, out / f)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
