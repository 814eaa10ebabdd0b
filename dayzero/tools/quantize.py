"""``dayzero quantize SRC DST [--format mxfp4|fp8]``: a low-precision copy of a checkpoint.

Streams the source one shard at a time (peak memory about one shard) and adds ``quantization_config`` to
``config.json``. ``mxfp4`` quantises every routed-expert tensor along its reduction (input) dimension with
the OCP MX rounding (``dayzero.quant.mxfp4``) in the layout the architecture's MXFP4 checkpoints use;
router, norms, attention, embeddings and LM head stay as they are. ``fp8`` writes DeepSeek's block-FP8
layout: every linear weight as e4m3 with a ``weight_scale_inv`` per 128×128 tile, except the modules
that stay in high precision (router, LM head, indexer head weights, embeddings, norms).
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from dayzero.loader.safetensors_loader import checkpoint_files
from dayzero.layers.fp8_linear import KEEP_HIGH, _in
from dayzero.quant.fp8 import quantize_fp8_blocks
from dayzero.quant.mxfp4 import BLOCK, quantize_mxfp4
from dayzero.tools.safetensors_out import write_safetensors


@dataclass(frozen=True)
class ExpertTensor:
    pattern: str  # checkpoint name of a stacked expert tensor; group 1 = prefix, group 2 = name
    to_out_in: Callable[[torch.Tensor], torch.Tensor]  # stored layout -> [E, out, in]


LAYOUTS = {
    # native: stacked [E, out, in] already
    "dayzero_hybrid": [ExpertTensor(r"(model\.layers\.\d+\.mlp)\.(w1|w2)", lambda t: t)],
    # transformers' gpt-oss layout: gate_up_proj [E, D, 2I], down_proj [E, I, D] (input dim first)
    "gpt_oss": [ExpertTensor(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)", lambda t: t.transpose(-1, -2))],
}
FP8_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
NOT_CONVERTED = {
    "gpt_oss": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "mxfp4", progress: bool = True) -> dict:
    src, dst = Path(src), Path(dst)
    if fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"format {fmt!r} is not supported; supported: mxfp4, fp8")
    with open(src / "config.json") as f:
        config = json.load(f)
    model_type = config.get("model_type")
    supported = sorted(LAYOUTS) if fmt == "mxfp4" else list(FP8_MODEL_TYPES)
    if model_type not in supported:
        raise ValueError(f"quantize --format {fmt} does not know the layout of model_type {model_type!r}; supported: {supported}")
    if (config.get("quantization_config") or {}).get("quant_method"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config']['quant_method']})")
    if dst.resolve() == src.resolve():
        raise ValueError("DST must differ from SRC")
    dst.mkdir(parents=True, exist_ok=True)
    rules = [(re.compile(e.pattern), e) for e in LAYOUTS.get(model_type, [])] if fmt == "mxfp4" else []
    files = checkpoint_files(src)
    weight_map, stats = {}, {"quantized": 0, "copied": 0, "bytes_before": 0, "bytes_after": 0}
    for n, file in enumerate(files):
        out = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in tqdm(list(f.keys()), desc=f"quantizing {file.name}", disable=not progress):
                t = f.get_tensor(name)
                stats["bytes_before"] += t.numel() * t.element_size()
                if fmt == "fp8":
                    if _fp8_target(name, t):
                        out[name], out[name + "_scale_inv"] = quantize_fp8_blocks(t)
                        stats["quantized"] += 1
                    else:
                        out[name] = t
                        stats["copied"] += 1
                    continue
                expert = next((e for r, e in rules if r.fullmatch(name)), None)
                if expert is None:
                    out[name] = t
                    stats["copied"] += 1
                    continue
                w = expert.to_out_in(t)
                if w.shape[-1] % BLOCK:
                    raise ValueError(f"{file}: {name} has input width {w.shape[-1]}, not a multiple of {BLOCK}: cannot be MXFP4")
                blocks, scales = quantize_mxfp4(w.float())
                out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
                stats["quantized"] += 1
        shard = file.name if len(files) > 1 else "model.safetensors"
        write_safetensors(out, dst / shard, metadata={"format": "pt"})
        stats["bytes_after"] += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update({k: shard for k in out})
    if len(files) > 1:
        with open(dst / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    for extra in src.iterdir():  # tokenizer, generation config, chat template...
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, dst / extra.name)
    config["quantization_config"] = dict(FP8_CONFIG) if fmt == "fp8" else {"quant_method": "mxfp4"}
    if fmt == "mxfp4" and model_type in NOT_CONVERTED:
        config["quantization_config"]["modules_to_not_convert"] = NOT_CONVERTED[model_type]
    with open(dst / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return stats


def _fp8_target(name: str, t: torch.Tensor) -> bool:
    """A 2-D linear weight outside the modules that stay in high precision."""
    if t.dim() != 2 or not name.endswith(".weight") or "embed" in name or "norm" in name:
        return False
    module = name[: -len(".weight")]
    return not any(_in(module, p) for p in KEEP_HIGH)
