"""RoPE frequencies, plain or YaRN (ARCHITECTURE.md 2.1), computed per position on the fly, or gathered from a
table where an engine on a CUDA device reserved one.

Tables are not made for every position by default: with 1M-token contexts a [1M, D/2] table per layer kind
would be hundreds of MB, while ``positions ⊗ inv_freq`` for the tokens of one step is tiny. But computing them
takes six small kernels a step (the cast, the product, cos, sin and two scalings: ~11 µs of a batch-1 decode
step on the H100), so an engine reserves a table for its longest sequence (:meth:`RotaryEmbedding.reserve`,
shared by rotaries of equal frequencies) where it takes at most :data:`TABLE_MAX_BYTES`: a step then gathers
its rows in one launch. The table is those same ops over every position, so its rows equal what a step would
compute. The frequencies follow transformers' definitions (fp32 ``inv_freq``), so parity tests match to fp32
rounding.

Multimodal RoPE (Qwen3-VL, Qwen3.5; ``spec.mrope_section = (s_t, s_h, s_w)``): each token has a temporal, a
height and a width position, and frequency slot j takes its angle from one of them, interleaved as
transformers lays it out: slot j reads the h axis when ``j % 3 == 1`` and ``j < 3 s_h``, the w axis when
``j % 3 == 2`` and ``j < 3 s_w``, and the t axis otherwise. A batch gives those positions as
``rope_positions`` [3, T] in steps whose chunks cover an image prompt's positions; otherwise the three axes
are equal and ``rope_positions`` is [T] (a token's index plus its sequence's rope delta: the plain path on
those positions, which a captured decode graph reads from its step buffer).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from dayzero import ops
from dayzero.config.spec import RopeScaling, RopeSpec, yarn_mscale


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    exps = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    extrapolation = 1.0 / base**exps
    interpolation = 1.0 / (s.factor * base**exps)

    def corr_dim(n_rot: float) -> float:  # the dim whose wavelength makes n_rot turns in the original context
        return dim * math.log(s.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1.0 - ramp  # 1 for high-frequency dims (extrapolated), 0 for low-frequency (interpolated)
    inv = interpolation * (1 - keep) + extrapolation * keep
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)
    return inv, factor


TABLE_MAX_BYTES = 64 << 20  # a reserved cos/sin table, at most


class RotaryEmbedding(nn.Module):
    def __init__(self, spec: RopeSpec):
        super().__init__()
        self.dim, self.interleaved, self.last = spec.dim, spec.interleaved, spec.last
        if spec.scaling is None:
            inv = 1.0 / spec.theta ** (torch.arange(0, spec.dim, 2, dtype=torch.float32) / spec.dim)
            self.cos_scale = 1.0
        else:
            inv, self.cos_scale = _yarn(spec.dim, spec.theta, spec.scaling)
        self.register_buffer("inv_freq", inv, persistent=False)
        # multimodal RoPE: [dim/2] int64, the position axis (0 t, 1 h, 2 w) of each frequency; None: 1-D positions
        axes = mrope_axes(spec.mrope_section, spec.dim // 2) if spec.mrope_section is not None else None
        self.register_buffer("axes", axes, persistent=False)
        # what the frequencies depend on: rotaries with equal keys share one cos/sin per step
        self.key = (spec.dim, spec.theta, spec.scaling, spec.mrope_section)
        self.table: torch.Tensor | None = None  # [positions, 2, dim/2]: cos and sin of every position, reserved

    def reserve(self, positions: int, shared: dict | None = None) -> bool:
        """Make the cos/sin table of positions [0, ``positions``) on the rotary's device, so :meth:`cos_sin` of
        positions below it gathers rows in one launch; for 1-D positions, where it takes at most
        :data:`TABLE_MAX_BYTES`. ``shared`` (frequencies' key -> table) gives the tables of rotaries reserved
        before, reused where the frequencies are equal. The caller vouches that no step reads a position past the
        table (an engine: its longest sequence). Returns whether the rotary has a table."""
        if self.axes is not None or positions * self.dim * 4 > TABLE_MAX_BYTES:
            return False
        shared = {} if shared is None else shared
        if self.key not in shared:
            cos, sin = self._compute(torch.arange(positions, device=self.inv_freq.device))
            shared[self.key] = torch.stack([cos, sin], 1)
        self.table = shared[self.key]
        return True

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T] -> cos, sin: [T, dim/2] fp32 (views of one gathered [T, 2, dim/2] with a reserved table)
        if self.table is not None and self.table.device == positions.device:
            both = self.table.index_select(0, positions)
            return both[:, 0], both[:, 1]
        return self._compute(positions)

    def _compute(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return freqs.cos() * self.cos_scale, freqs.sin() * self.cos_scale

    def mrope_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [3, T] (t, h, w) -> cos, sin: [T, dim/2] fp32, frequency j at the position of axis axes[j]
        freqs = positions.index_select(0, self.axes).t().float() * self.inv_freq.float()[None, :]
        return freqs.cos() * self.cos_scale, freqs.sin() * self.cos_scale

    def _step_positions(self, batch):
        mm = getattr(batch, "rope_positions", None) if self.axes is not None else None
        if mm is None:
            return self.cos_sin, batch.positions
        return (self.cos_sin, mm) if mm.dim() == 1 else (self.mrope_cos_sin, mm)  # 1-D: three equal axes

    def step_cos_sin(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin of the step's positions, computed once per forward pass for every rotary with these
        frequencies (the MLA and indexer rotaries of all layers: six kernels each, otherwise per layer)."""
        fn, positions = self._step_positions(batch)
        memo = getattr(batch, "memo", None)
        if memo is None:
            return fn(positions)
        key = ("cos_sin", self.key)
        got = memo.get(key)
        if got is None:
            got = memo[key] = fn(positions)
        return got

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates the first (or, with ``spec.last``, the last) ``dim`` channels of each head of x: [T, H, D];
        the rest pass through. ``-sin`` rotates back (DeepSeek-V4 un-rotates its attention output)."""
        start = self.start(x.shape[-1])
        if start is None:
            return ops.call("rotary", x, cos, sin, self.interleaved)
        return ops.call("rotary", x, cos, sin, self.interleaved, start=start)

    def start(self, width: int) -> int | None:
        """The first rotated channel of a head of ``width`` channels (the rotary op's ``start``), None when the
        whole head turns; a partial rotary's other channels pass through in the same call."""
        if width == self.dim:
            return None
        return width - self.dim if self.last else 0


def reserve_tables(model: nn.Module, positions: int, device: torch.device) -> int:
    """:meth:`RotaryEmbedding.reserve` for every rotary of ``model`` on a CUDA device (where the six launches cost;
    the CPU computes a step's rows as cheaply); returns how many have a table."""
    if device.type != "cuda":
        return 0
    shared: dict = {}  # rotaries of equal frequencies (the MLA and indexer rotaries of all layers) share one
    return sum(m.reserve(positions, shared) for m in model.modules() if isinstance(m, RotaryEmbedding))


def mrope_axes(section: tuple[int, ...], half: int) -> torch.Tensor:
    """[half] int64: which position axis (0 t, 1 h, 2 w) frequency slot j reads, in the interleaved layout."""
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {list(section)} must be 3 sizes adding up to the {half} rotated frequencies")
    axes = torch.zeros(half, dtype=torch.int64)
    for axis in (1, 2):
        axes[axis:3 * section[axis]:3] = axis
    return axes
