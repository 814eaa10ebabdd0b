"""Streaming safetensors loader: one tensor at a time from a single file or an indexed set of shards,
mapped onto the model's parameters by the architecture's name table, checked, and copied into place.

Every failure names the file and the tensor: a missing shard, a file safetensors cannot read, a tensor
with the wrong shape or dtype, a tensor the model needs that no file holds, a tensor the model does not
use. :func:`check_headers` runs the same mapping over the headers alone (no tensor data is read), so a
checkpoint of terabytes is checked against its config in seconds.

Under tensor parallelism a parameter holds one rank's slice and declares how (``shards``, see
:mod:`dayzero.layers.parallel`): after its rule's transform each checkpoint tensor is narrowed to that slice, and
a tensor with no transform is read as the slice alone, so a rank reads and keeps only its part. Under expert
parallelism a checkpoint tensor of one expert that another rank holds is not read at all, and under pipeline
parallelism neither is one of a layer another stage holds.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from dayzero.layers.parallel import Shard, parameter_shards
from dayzero.loader.rules import Rule, same

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E8M0": torch.float8_e8m0fnu,  # UE8M0 block scales (DeepSeek-V4)
}


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


def read_header(file: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """name -> (shape, dtype) from a safetensors header, reading no tensor data."""
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = file.stat().st_size
            if n <= 0 or n > size - 8:
                raise ValueError(f"header length {n} does not fit a file of {size} bytes")
            header = json.loads(f.read(n))
        out = {}
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            out[name] = (tuple(info["shape"]), _DTYPES.get(info["dtype"], torch.uint8))
            end = max(end, info["data_offsets"][1])
        if 8 + n + end > size:
            raise ValueError(f"tensors need {8 + n + end} bytes, the file has {size}; it is truncated")
        return out
    except (ValueError, KeyError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from e


@dataclass(frozen=True)
class _Cut:
    """The rank's slice of a (transformed) checkpoint tensor: along ``dim`` (negative, counted from the end: a view
    and the stored tensor share their trailing dims) piece j = (start, length, held) gives stored rows
    [start, start + length) to the view's next ``held`` rows, in order; the rest of each ``held`` rows is padding,
    zero-filled."""

    dim: int
    pieces: tuple[tuple[int, int, int], ...]

    def shape(self, stored) -> torch.Size:
        """The shape the cut gives a stored tensor of shape ``stored``."""
        out = list(stored)
        out[len(out) + self.dim] = sum(held for _, _, held in self.pieces)
        return torch.Size(out)


def _cut(shard: Shard, param: torch.Tensor, view: torch.Tensor, stored: torch.Size) -> _Cut | str:
    """The :class:`_Cut` of a stored tensor of shape ``stored`` into ``view`` of a parameter sharded by ``shard``,
    or why it does not fit."""
    d = shard.dim - param.dim()
    if len(stored) < -d or view.dim() < -d:
        return f"has {len(stored)} dims, too few to cut along dim {shard.dim} of the parameter"
    n = stored[d]
    if shard.widths:  # unequal parts, each cut into equal pieces: the whole parameter at once
        if view.shape[d] != param.shape[d] or n != sum(shard.widths):
            return f"is not the {sum(shard.widths)} rows of parts {shard.widths} along dim {shard.dim}"
        starts = [sum(shard.widths[:j]) for j in range(len(shard.widths))]
        per = [w // shard.size for w in shard.widths]
        cut = _Cut(d, tuple((o + shard.rank * p, p, p) for o, p in zip(starts, per)))
    else:
        parts = shard.parts * view.shape[d] // param.shape[d]  # the parts of the sharded tensor this view spans
        if parts < 1 or n % parts or shard.parts * view.shape[d] % param.shape[d]:
            return f"cannot be cut into {max(parts, 1)} parts along dim {shard.dim}"
        step = n // parts
        start, length, held = shard.span(step)
        cut = _Cut(d, tuple((j * step + start, length, held) for j in range(parts)))
    if cut.shape(stored) != view.shape:
        return f"gives {cut.shape(stored)[d]} rows along dim {shard.dim} to tp rank {shard.rank} of {shard.size}"
    return cut


def _cuts(shard: Shard, param: torch.Tensor, view: torch.Tensor, stored: torch.Size) -> tuple[_Cut, ...] | str | None:
    """The cuts of a stored tensor into ``view``: along the shard's dim (not for one expert's part, which goes whole
    to its slot), then along its ``inner`` shard's dim; None when nothing is cut, or why it does not fit."""
    out = []
    if not (shard.experts and view.dim() < param.dim()):
        whole = view  # what the first cut gives: the view, but whole along the inner cut's dim
        if shard.inner is not None and len(stored) >= param.dim() - shard.inner.dim:
            d = shard.inner.dim - param.dim()
            shape = list(view.shape)
            shape[d] = stored[d]
            whole = torch.empty(shape, dtype=view.dtype, device="meta")
        cut = _cut(shard, _filled(param, shard), whole, stored)
        if isinstance(cut, str):
            return cut
        out.append(cut)
        stored = cut.shape(stored)
    if shard.inner is not None:
        cut = _cut(shard.inner, param, view, stored)
        if isinstance(cut, str):
            return cut
        out.append(cut)
    return tuple(out) or None


def _target(rule: Rule, m: re.Match, param: torch.Tensor, shard: Shard | None) -> torch.Tensor | None:
    """The part of ``param`` the checkpoint tensor fills; None when it is one expert's part and another ep rank
    holds that expert. A rule views the whole stack of experts, so for a parameter holding this rank's experts
    the view is taken on the whole (meta) stack and moved onto the rank's rows when its expert is here."""
    if shard is None or not shard.experts:
        return rule.view(param, m)
    n = shard.experts
    whole = torch.empty((n * shard.size,) + tuple(param.shape[1:]), dtype=param.dtype, device="meta")
    view = rule.view(whole, m)
    if view.dim() == param.dim() and view.shape[0] == whole.shape[0]:
        return rule.view(param.narrow(0, 0, n), m)  # the whole stack: cut along dim 0 like any sharded tensor
    first = shard.rank * n
    if not first <= view.storage_offset() // whole.stride(0) < first + n:
        return None
    return param.as_strided(view.shape, view.stride(), view.storage_offset() - first * param.stride(0))


def _filled(param: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """The part of ``param`` the checkpoint fills: an expert stack's first ``shard.experts`` slots, else all."""
    return param.narrow(0, 0, shard.experts) if shard is not None and shard.experts else param


@dataclass
class _Plan:
    """Where each checkpoint tensor goes (and the rank's slice of it), and what the model still misses."""

    assignments: list[tuple[Path, str, Rule, re.Match, str, _Cut | None]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _first_match(rules: Iterable[Rule], name: str):
    for r in rules:
        m = r.match(name)
        if m is not None:
            return r, m
    return None, None


def _plan(model: torch.nn.Module, path: Path, rules: list[Rule], ignore: list[str]) -> _Plan:
    params = dict(model.named_parameters())
    shards = parameter_shards(model)
    elsewhere = getattr(model, "elsewhere", ())
    ignore_re = [re.compile(p) for p in ignore]
    plan = _Plan()
    covered: dict[str, int] = {n: 0 for n in params}
    for file in checkpoint_files(path):
        for name, (shape, dtype) in read_header(file).items():
            rule, m = _first_match(rules, name)
            target = rule.param_name(m) if rule else None
            if target is not None and target.startswith(elsewhere):
                continue  # another pipeline stage holds it
            if target not in params:
                if not any(r.fullmatch(name) for r in ignore_re):
                    plan.unexpected.append(f"{name} (in {file.name})")
                continue
            param = params[target]
            view = _target(rule, m, param, shards.get(target))
            if view is None:
                continue  # another ep rank's expert
            stored = rule.transform(torch.empty(shape, dtype=dtype, device="meta"))  # as the parameter receives it
            got, cut = tuple(stored.shape), None
            if target in shards:
                cut = _cuts(shards[target], param, view, stored.shape)
                if isinstance(cut, str):
                    plan.problems.append(f"{file}: tensor {name!r} of shape {shape} {cut}; {target} holds "
                                         f"{tuple(view.shape)}")
                    continue
                if cut is not None:
                    got = tuple(view.shape)  # checked by the cuts, the slice has the view's shape
            if got != tuple(view.shape):
                plan.problems.append(
                    f"{file}: tensor {name!r} has shape {shape}, the model built from config.json expects "
                    f"{tuple(view.shape)} for {target}")
                continue
            if stored.dtype.is_floating_point != param.dtype.is_floating_point:
                plan.problems.append(f"{file}: tensor {name!r} has dtype {dtype}, {target} is {param.dtype}")
                continue
            covered[target] += view.numel()
            plan.assignments.append((file, name, rule, m, target, cut))
    missing = [n for n, c in covered.items() if c < _filled(params[n], shards.get(n)).numel()]
    if missing:
        plan.problems.append(f"tensors the model needs are missing from the checkpoint: {missing}")
    return plan


def check_headers(model: torch.nn.Module, path: str | Path, rules: list[Rule], ignore: list[str] = ()) -> list[str]:
    """Every mismatch between the checkpoint's tensors (names, shapes, dtypes) and the model, from headers only.
    ``model`` may live on the meta device."""
    plan = _plan(model, Path(path), rules, list(ignore))
    extra = [f"tensors in the checkpoint that the model does not use: {plan.unexpected}"] if plan.unexpected else []
    return plan.problems + extra


def load_weights(model: torch.nn.Module, path: str | Path, rules: list[Rule], ignore: list[str] = (),
                 strict: bool = True, progress: bool | None = None) -> None:
    path = Path(path)
    plan = _plan(model, path, rules, list(ignore))
    problems = list(plan.problems)
    if plan.unexpected and strict:
        problems.append(f"tensors in the checkpoint that the model does not use: {plan.unexpected}")
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    params = dict(model.named_parameters())
    shards = parameter_shards(model)
    show = progress if progress is not None else len(plan.assignments) > 200
    handles: dict[Path, object] = {}
    with torch.no_grad():
        for file, name, rule, m, target, cut in tqdm(plan.assignments, desc=f"loading {path.name}", unit="tensor",
                                                     disable=not show):
            if file not in handles:
                handles[file] = safe_open(str(file), framework="pt", device="cpu")
            param = params[target]
            view = _target(rule, m, param, shards.get(target))
            sliced = cut is not None and len(cut) == 1 and rule.transform is same
            grouped = _rank_rows(rule, shards.get(target), cut, view, param)
            try:
                if sliced:  # the rank's rows of each piece read alone, never the rest of the tensor
                    handle = handles[file].get_slice(name)
                    _copy_cut(view, lambda start, n: _read_rows(handle, cut[0].dim, start, n), cut[0])
                    continue
                if grouped is not None:  # the rank's run of row groups, transformed alone
                    start, n, transform = grouped
                    handle = handles[file].get_slice(name)
                    view.copy_(transform(_read_rows(handle, -len(handle.get_shape()), start, n)).to(param.dtype))
                    continue
                t = handles[file].get_tensor(name)
            except Exception as e:  # safetensors raises its own error types for damaged data
                raise CheckpointError(f"{file}: tensor {name!r} cannot be read ({e}); the file may be truncated") from e
            t = rule.transform(t)
            if cut is None:
                view.copy_(t.to(param.dtype))
                continue
            for c in cut[:-1]:  # expert slots before each expert's width: an earlier cut into a tensor of its own
                outer = t.new_empty(c.shape(t.shape))
                _copy_cut(outer, lambda start, n, t=t, d=c.dim: t.narrow(d, start, n), c)
                t = outer
            _copy_cut(view, lambda start, n, t=t: t.narrow(cut[-1].dim, start, n), cut[-1])


def _rank_rows(rule: Rule, shard: Shard | None, cut, view: torch.Tensor, param: torch.Tensor):
    """(start, length, transform) of the stored rows a rank reads for a transform made of row groups
    (:func:`~dayzero.loader.rules.per_group`) when its parameter holds an equal share of every part along dim 0;
    else None (the tensor is read whole and cut after its transform)."""
    rank_rows = getattr(rule.transform, "rank_rows", None)
    if rank_rows is None or cut is None or len(cut) != 1 or shard is None or shard.experts or shard.inner:
        return None
    if shard.dim != 0 or view.shape != param.shape or any(length != held for _, length, held in cut[0].pieces):
        return None
    return rank_rows(shard.rank, shard.size)


def _read_rows(handle, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows [start, start + length) along ``dim`` (negative) of a stored tensor, read without the rest of it."""
    ndim = len(handle.get_shape())
    index = [slice(None)] * ndim
    index[ndim + dim] = slice(start, start + length)
    return handle[tuple(index)]


def _copy_cut(view: torch.Tensor, rows, cut: _Cut) -> None:
    """Copy the cut's pieces into ``view``, padding zeroed; ``rows(start, length)`` gives the stored rows."""
    d, at = cut.dim, 0
    for start, length, held in cut.pieces:
        dst = view.narrow(d, at, held)
        dst.narrow(d, 0, length).copy_(rows(start, length).to(view.dtype))
        if length < held:
            dst.narrow(d, length, held - length).zero_()
        at += held
