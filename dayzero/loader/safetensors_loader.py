"""Streaming safetensors loader: one tensor at a time from a single file or an indexed set of shards,
mapped onto the model's parameters, checked for shape, and copied into place.

Every failure names the file and the tensor: a missing shard, a file safetensors cannot read, a tensor
with the wrong shape, a tensor the model needs that no file holds, a tensor the model does not use.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm


class CheckpointError(RuntimeError):
    pass


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({path / name for name in weight_map.values()})
        missing = [p.name for p in files if not p.exists()]
        if missing:
            raise CheckpointError(f"{index}: shard(s) {missing} listed in the index are missing from {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {path}")
    return files


def load_weights(model: torch.nn.Module, path: str | Path, strict: bool = True, progress: bool | None = None) -> None:
    path = Path(path)
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {n for n, p in params.items() if any(p is q and n != m for m, q in params.items())}
    loaded: set[str] = set()
    unexpected: list[str] = []
    files = checkpoint_files(path)
    total = 0
    handles = []
    for file in files:
        try:
            handles.append((file, safe_open(str(file), framework="pt", device="cpu")))
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e
        total += len(handles[-1][1].keys())
    show = progress if progress is not None else total > 200
    bar = tqdm(total=total, desc=f"loading {path.name}", unit="tensor", disable=not show)
    with torch.no_grad():
        for file, f in handles:
            for name in f.keys():
                bar.update()
                param = params.get(name)
                if param is None:
                    unexpected.append(f"{name} (in {file.name})")
                    continue
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e}); the file may be truncated") from e
                if tuple(t.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{file}: tensor {name!r} has shape {tuple(t.shape)}, the model built from config.json expects {tuple(param.shape)}"
                    )
                if t.dtype.is_floating_point != param.dtype.is_floating_point:
                    raise CheckpointError(f"{file}: tensor {name!r} has dtype {t.dtype}, the model expects {param.dtype}")
                param.copy_(t.to(param.dtype))
                loaded.add(name)
    bar.close()
    # a tied parameter is satisfied by any of its names
    missing = [n for n, p in params.items() if n not in loaded and not (n in tied and any(
        m in loaded for m, q in params.items() if q is p))]
    problems = []
    if missing:
        problems.append(f"tensors the model needs are missing from the checkpoint: {missing}")
    if unexpected and strict:
        problems.append(f"tensors in the checkpoint that the model does not use: {unexpected}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
