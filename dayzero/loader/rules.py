"""Declarative checkpoint name tables: one :class:`Rule` per family of checkpoint tensors.

A rule matches a checkpoint name (a full regex match), names the parameter it feeds (``target``, a
template over the match's groups, ``{0}``, ``{1}``...), picks the part of that parameter it fills
(``view``: the whole parameter, one expert's slice, the gate or up half...) and says how the stored
tensor becomes that part (``transform``: transpose, reshape, de-interleave). Every parameter's loading
rule lives here, so the same table drives loading, header-only structure checks, and later sharding.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch

View = Callable[[torch.Tensor, re.Match], torch.Tensor]
Transform = Callable[[torch.Tensor], torch.Tensor]


def whole(p: torch.Tensor, m: re.Match) -> torch.Tensor:
    return p


def same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Rule:
    pattern: str
    target: str
    view: View = whole
    transform: Transform = same
    regex: re.Pattern = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "regex", re.compile(self.pattern))

    def match(self, name: str) -> re.Match | None:
        return self.regex.fullmatch(name)

    def param_name(self, m: re.Match) -> str:
        return self.target.format(*m.groups())


# --- views: which part of a parameter a checkpoint tensor fills ---------------------------------------
def expert(group: int = 2) -> View:
    """``p[e]`` for stacked expert weights; ``e`` is the regex group number ``group`` (1-based)."""
    return lambda p, m: p[int(m.group(group))]


def rows(part: int, parts: int, expert_group: int | None = None, axis: int | None = None) -> View:
    """The ``part``-th of ``parts`` equal row blocks (e.g. gate = 0, up = 1 of a fused [gate; up]); rows are the
    second-to-last dim (the only one of a 1-D tensor) unless ``axis`` says otherwise (packed MXFP4 codes
    [2I, K/32, 16] have theirs first)."""

    def view(p, m):
        if expert_group is not None:
            p = p[int(m.group(expert_group))]
        dim = axis if axis is not None else (p.dim() - 2 if p.dim() > 1 else 0)
        n = p.shape[dim] // parts
        return p.narrow(dim, part * n, n)

    return view


def cols_of_rows(part: int, parts: int) -> View:
    """For biases stacked [E, 2I]: the ``part``-th half along the last dim."""
    return lambda p, m: p.narrow(-1, part * (p.shape[-1] // parts), p.shape[-1] // parts)


# --- transforms ----------------------------------------------------------------------------------------
def transpose_last2(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[.., 2I, D] with gate/up rows alternating (even = gate) -> [.., 2I, D] as [gate; up]."""
    return torch.cat((t[..., 0::2, :], t[..., 1::2, :]), dim=-2)


def deinterleave_packed_rows(t: torch.Tensor) -> torch.Tensor:
    """MXFP4 codes [.., 2I, K/32, 16] with gate/up rows alternating -> [gate; up] rows."""
    return torch.cat((t[..., 0::2, :, :], t[..., 1::2, :, :]), dim=-3)


def deinterleave_last(t: torch.Tensor) -> torch.Tensor:
    """[.., 2I] alternating -> [gate; up] (biases)."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (one exponent byte each, ``float8_e8m0fnu``) -> fp32 ``2^(byte - 127)``."""
    return torch.exp2(t.view(torch.uint8).float() - 127)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes (E8M0 scales kept packed, as MXFP4 experts hold them)."""
    return t.view(torch.uint8)


def fp4_pairs_to_blocks(t: torch.Tensor) -> torch.Tensor:
    """Packed FP4 [.., K/2] (two E2M1 codes per byte, the first in the low nibble: DeepSeek-V4's experts)
    -> MXFP4 codes [.., K/32, 16], the same bytes grouped by 32-value block."""
    return t.view(torch.uint8).unflatten(-1, (-1, 16))


def as_out_in(out: int, inp: int) -> Transform:
    """A stacked weight stored either [.., out, in] (our layout) or [.., in, out] (transformers' in-memory
    expert layout, e.g. gpt-oss ``gate_up_proj`` [E, D, 2I]) -> [.., out, in], told apart by shape. A
    square one (out == in) cannot be told apart and is read as [.., in, out], the layout transformers writes."""

    def transform(t: torch.Tensor) -> torch.Tensor:
        return t if tuple(t.shape[-2:]) == (out, inp) and out != inp else t.transpose(-1, -2)

    return transform


def pairs_to_halves(heads: int, parts: int = 1, rotated: int | None = None) -> Transform:
    """Stacked projections [parts*H*Dh, ..] (a weight or a bias) whose first ``rotated`` parts (all unless said)
    rotate complex pairs -> rotate-half order: within each head, rows 2i and 2i+1 become rows i and Dh/2 + i.
    E.g. a fused [q; k; v] with rotary q and k is ``parts=3, rotated=2``."""

    def transform(t: torch.Tensor) -> torch.Tensor:
        blocks = list(t.chunk(parts))  # each [H*Dh, ..]
        for j in range(parts if rotated is None else rotated):
            b = blocks[j]
            blocks[j] = b.reshape(heads, -1, 2, *b.shape[1:]).transpose(1, 2).reshape(b.shape)
        return torch.cat(blocks)

    return transform


def per_group(groups: int, rows: int, transform_of: Callable[[int], Transform]) -> Transform:
    """A transform of a stored tensor of ``groups`` consecutive blocks of ``rows`` rows (one per key head, say) into
    parts that keep the blocks' order, ``transform_of(n)`` doing it for n blocks. It also says which stored rows
    a tensor-parallel rank needs when it holds an equal share of every part (``rank_rows(rank, size)``: start,
    length, and the transform of those rows alone), so that rank reads its run of blocks and nothing else."""
    transform = transform_of(groups)

    def rank_rows(rank: int, size: int) -> tuple[int, int, Transform]:
        n = groups // size
        return rank * n * rows, n * rows, transform_of(n)

    transform.rank_rows = rank_rows
    return transform


def chain(*transforms: Transform) -> Transform:
    """Apply ``transforms`` left to right."""

    def transform(t: torch.Tensor) -> torch.Tensor:
        for f in transforms:
            t = f(t)
        return t

    return transform




def identity_rules() -> list[Rule]:
    """Checkpoint names equal parameter names (the native format)."""
    return [Rule(r"(.+)", "{0}")]
