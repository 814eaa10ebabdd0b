"""``dayzero quantize SRC DST``: a copy of a checkpoint with its routed experts in MXFP4.

Streams the source one shard at a time (peak memory about one shard), quantises every routed-expert
tensor along its reduction (input) dimension with the OCP MX rounding (``dayzero.quant.mxfp4``), writes
them in the layout the architecture's MXFP4 checkpoints use, copies everything else unchanged, and adds
``quantization_config`` to ``config.json``. Router, norms, attention, embeddings and LM head stay as they are.
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
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dayzero.loader.safetensors_loader import checkpoint_files
from dayzero.quant.mxfp4 import BLOCK, quantize_mxfp4


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
NOT_CONVERTED = {
    "gpt_oss": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def quantize_checkpoint(src: str | Path, dst: str | Path, fmt: str = "mxfp4", progress: bool = True) -> dict:
    src, dst = Path(src), Path(dst)
    if fmt != "mxfp4":
        raise ValueError(f"format {fmt!r} is not supported; supported: mxfp4")
    with open(src / "config.json") as f:
        config = json.load(f)
    model_type = config.get("model_type")
    if model_type not in LAYOUTS:
        raise ValueError(f"quantize does not know the expert layout of model_type {model_type!r}; supported: {sorted(LAYOUTS)}")
    if (config.get("quantization_config") or {}).get("quant_method"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config']['quant_method']})")
    if dst.resolve() == src.resolve():
        raise ValueError("DST must differ from SRC")
    dst.mkdir(parents=True, exist_ok=True)
    rules = [(re.compile(e.pattern), e) for e in LAYOUTS[model_type]]
    files = checkpoint_files(src)
    weight_map, stats = {}, {"quantized": 0, "copied": 0, "bytes_before": 0, "bytes_after": 0}
    for n, file in enumerate(files):
        out = {}
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in tqdm(list(f.keys()), desc=f"quantizing {file.name}", disable=not progress):
                t = f.get_tensor(name)
                stats["bytes_before"] += t.numel() * t.element_size()
                m = next((m for r, e in rules if (m := r.fullmatch(name))), None)
                if m is None:
                    out[name] = t
                    stats["copied"] += 1
                    continue
                w = next(e for r, e in rules if r.fullmatch(name)).to_out_in(t)
                if w.shape[-1] % BLOCK:
                    raise ValueError(f"{file}: {name} has input width {w.shape[-1]}, not a multiple of {BLOCK}: cannot be MXFP4")
                blocks, scales = quantize_mxfp4(w.float())
                out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
                stats["quantized"] += 1
        shard = file.name if len(files) > 1 else "model.safetensors"
        save_file(out, str(dst / shard), metadata={"format": "pt"})
        stats["bytes_after"] += sum(t.numel() * t.element_size() for t in out.values())
        weight_map.update({k: shard for k in out})
    if len(files) > 1:
        with open(dst / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    for extra in src.iterdir():  # tokenizer, generation config, chat template...
        if extra.is_file() and not extra.name.endswith(".safetensors") and extra.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, dst / extra.name)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    if model_type in NOT_CONVERTED:
        config["quantization_config"]["modules_to_not_convert"] = NOT_CONVERTED[model_type]
    with open(dst / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    return stats
