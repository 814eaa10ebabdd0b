"""Structure alignment from safetensors headers alone: every checkpoint tensor's name, shape and dtype
against the model ``config.json`` implies, through the architecture's own name table (the rules the
loader uses). No tensor data is read, so a checkpoint of terabytes is checked in seconds.
"""
from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dayzero.loader.safetensors_loader import CheckpointError, check_headers, checkpoint_files, read_header
from dayzero.tools.model_info import ModelInfo, component_of, stored_label

@dataclass(frozen=True)
class Mismatch:
    kind: str  # "shape" | "dtype" | "missing" | "unexpected" | "unreadable" | "loader"
    tensor: str
    file: str
    detail: str


def check_checkpoint(info: ModelInfo, path: Path | None = None) -> dict:
    """Mismatches (by tensor and file) and the bytes on disk by format and component."""
    path = Path(path or info.checkpoint)
    params = dict(info.model.named_parameters())
    rules = info.adapter.rules(info.spec)
    ignore = [re.compile(p) for p in info.adapter.ignore]
    covered = dict.fromkeys(params, 0)
    misfit: set[str] = set()  # parameters with a wrongly shaped tensor: reported once, not again as missing
    problems: list[Mismatch] = []
    on_disk: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    n_tensors, files = 0, []
    try:
        files = checkpoint_files(path)
    except CheckpointError as e:
        problems.append(Mismatch("unreadable", "-", str(path), str(e)))
    for file in files:
        try:
            header = read_header(file)
        except CheckpointError as e:
            problems.append(Mismatch("unreadable", "-", file.name, str(e)))
            continue
        for name, (shape, dtype) in header.items():
            n_tensors += 1
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            rule = m = None
            for r in rules:
                m = r.match(name)
                if m is not None:
                    rule = r
                    break
            target = rule.param_name(m) if rule is not None else None
            if target not in params:
                ignored = any(r.fullmatch(name) for r in ignore)
                on_disk[stored_label(name, dtype)]["ignored" if ignored else "unused"] += nbytes
                if not ignored:
                    problems.append(Mismatch("unexpected", name, file.name, "the model built from config.json has no "
                                             "parameter for this tensor"))
                continue
            on_disk[stored_label(name, dtype)][component_of(info.spec, target)[1]] += nbytes
            param = params[target]
            want = tuple(rule.view(param, m).shape)
            try:
                got = tuple(rule.transform(torch.empty(shape, dtype=dtype, device="meta")).shape)
            except (RuntimeError, ValueError) as e:
                got, want = f"{shape} (cannot be mapped: {e})", want
            if got != want:
                misfit.add(target)
                problems.append(Mismatch("shape", name, file.name, f"shape {tuple(shape)}, config.json implies {want} "
                                                                   f"for {target}"))
            elif dtype.is_floating_point != param.dtype.is_floating_point:
                problems.append(Mismatch("dtype", name, file.name, f"dtype {stored_label(name, dtype)}, {target} "
                                                                   f"is {str(param.dtype).removeprefix('torch.')}"))
            else:
                covered[target] += int(torch.Size(want).numel())
    for target, n in covered.items():
        need = params[target].numel()
        if n < need and target not in misfit:
            what = "no checkpoint tensor fills it" if n == 0 else f"checkpoint tensors fill {n} of {need} elements"
            problems.append(Mismatch("missing", target, "-", f"{what} (shape {tuple(params[target].shape)})"))
    if not problems and files:  # the loader's own check is the final word
        try:
            extra = check_headers(info.model, path, rules, list(info.adapter.ignore))
        except CheckpointError as e:
            extra = [str(e)]
        problems += [Mismatch("loader", "-", "-", p) for p in extra]
    by_format = {fmt: dict(comps) for fmt, comps in on_disk.items()}
    return {
        "path": str(path),
        "files": len(files),
        "tensors": n_tensors,
        "bytes": sum(sum(c.values()) for c in by_format.values()),
        "by_format": by_format,
        "mismatches": [asdict(p) for p in problems],
        "ok": not problems,
    }
