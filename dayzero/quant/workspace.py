"""The expert workspace: packed MXFP4 experts are converted here, one MoE layer at a time.

MoE layers whose experts are stored packed (4.25 bits per weight) never hold them in full precision.
Before a layer's experts run, :meth:`ExpertWorkspace.acquire` converts that layer's experts into buffers
that every MoE layer reuses, in BF16 or in FP8 (E4M3 codes with one power-of-two scale per 32-element
block: every E2M1 value times its E8M0 scale is exactly an E4M3 value times that scale, so the FP8
workspace is lossless and half the size of the BF16 one). With FP8 activations the FP8 workspace keeps one
scale per 128x128 tile instead (:func:`tile_shift`: lossless while a tile's block scales span at most 14
binades), the layout whose products the expert kernels run FP8 x FP8, and ``auto`` converts large steps into
it rather than into BF16. On CUDA the workspace keeps two slots and a
side stream: while layer i computes from one slot, :meth:`prefetch` converts layer i+1 into the other.

With ``compute="fused"`` nothing is converted: :meth:`acquire` hands out the packed weights themselves
(:class:`PackedMXFP4`), for expert kernels that dequantise inside their inner loop (the Triton expert kernels
on a GPU); paths without such a kernel dequantise one expert at a time (``w[e]``), which is slow.

``compute="auto"`` (the default) chooses per step: a conversion writes every expert of the layer, however few
rows the step routes to them, so a step with at most :data:`FUSED_ROWS_PER_EXPERT` rows per expert on average
(decode, small prefill chunks) reads the packed weights as ``fused`` does, and a larger one converts into a
BF16 workspace, where the expert GEMMs run at the bf16 tensor-core rate. On the H200 a 64-expert layer
(4096 : 2048) converts in ~1.7 ms, as long as its bf16 GEMMs take at ~500 rows per expert, while the packed
kernels read 0.53 bytes a weight of the experts a step uses (``docs/performance.md``).

On a CPU there are no such kernels: a small step under ``auto`` reads each expert it routes to through
``w[e]``, which dequantises it. The workspace keeps what those reads produce (fp32, per layer and expert, up to
:data:`CPU_DEQUANTISED_BYTES` in all, counted in :attr:`ExpertWorkspace.nbytes`), so an expert is dequantised
once rather than in every decode step; the values are the same either way.

Inside CUDA-graph capture nothing is cached: a replay runs later, when the slots hold whatever ran last,
so every :meth:`acquire` converts in the graph, on the capturing stream, and :meth:`prefetch` does nothing
(work on the side stream would not be joined into the graph). Whoever runs steps calls
:meth:`invalidate` before each one, so that eager steps do not trust what a replay may have overwritten.
"""
from __future__ import annotations

import torch

from dayzero.quant.convert_kernels import convert_mxfp4, convert_refusal, convert_mxfp4_tiles
from dayzero.quant.fp8 import TILE, TileScaled
from dayzero.quant.mxfp4 import (BLOCK, block_values, dequantize_mxfp4, e4m3_pair_table, e8m0_table, fp4_lut,
                                 scale_values, value_pair_table)

COMPUTE = ("auto", "bf16", "fp8", "fused")
FUSED_ROWS_PER_EXPERT = 128  # "auto": steps with at most this many rows per expert read the packed weights
CPU_DEQUANTISED_BYTES = 1 << 30  # "auto" on a CPU: the most dequantised experts kept for small steps


def reads_packed(compute: str, rows_per_expert: float | None, fused_rows: float = FUSED_ROWS_PER_EXPERT) -> bool:
    """Whether expert compute mode ``compute`` reads the packed weights rather than a converted copy in a step
    routing ``rows_per_expert`` rows to each expert on average (None: unknown); the engine's rule, and the
    plan's."""
    if compute == "fused":
        return True
    return compute == "auto" and rows_per_expert is not None and rows_per_expert <= fused_rows


def converts_to_tiles(compute: str, fp8_activations: bool) -> bool:
    """Whether expert compute mode ``compute`` converts MXFP4 experts into FP8 tiles (one fp32 scale per 128 x 128,
    multiplied FP8 x FP8) rather than its own workspace format; the engine's rule, and the plan's."""
    return fp8_activations and compute in ("fp8", "auto")


class BlockScaled:
    """FP8 expert weights with per-32-block scales; indexing an expert gives its dequantised fp32 weight
    (what a reference GEMM needs). ``data`` [E, N, K] e4m3, ``scale`` [E, N, K/32] fp32."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor):
        self.data, self.scale = data, scale
        self.shape = data.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        return self.data[e].float() * self.scale[e].repeat_interleave(BLOCK, dim=-1)

    def float(self) -> torch.Tensor:
        return self.data.float() * self.scale.repeat_interleave(BLOCK, dim=-1)


class PackedMXFP4:
    """MXFP4 expert weights as stored (the ``fused`` conversion mode: kernels that dequantise in their inner
    loop read these directly, so no workspace is needed). ``blocks`` [E, N, K/32, 16] uint8 (two E2M1 codes
    per byte, low nibble = even element), ``scales`` [E, N, K/32] uint8 E8M0; ``shape`` is (E, N, K) like
    the other expert containers, and indexing an expert gives its dequantised fp32 weight (for references).
    ``kept``: a :class:`DequantisedExperts` that keeps those weights for later steps."""

    def __init__(self, blocks: torch.Tensor, scales: torch.Tensor, kept: DequantisedExperts | None = None):
        if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or scales.shape != blocks.shape[:-1]:
            raise ValueError(f"MXFP4 blocks must be [E, N, K/32, 16] with scales [E, N, K/32], "
                             f"got {tuple(blocks.shape)} and {tuple(scales.shape)}")
        self.blocks, self.scales, self.kept = blocks, scales, kept
        self.shape = torch.Size((*blocks.shape[:2], blocks.shape[2] * BLOCK))

    def __getitem__(self, e: int) -> torch.Tensor:
        if self.kept is not None:
            return self.kept.get(self.blocks, self.scales, e)
        return dequantize_mxfp4(self.blocks[e], self.scales[e], torch.float32)

    def float(self) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, torch.float32)


class DequantisedExperts:
    """Experts' fp32 weights as :class:`PackedMXFP4` dequantises them, kept by (packed tensor, expert) until
    ``budget`` bytes are held; past it an expert is dequantised at each read, as without this."""

    def __init__(self, budget: int):
        self.budget, self.nbytes = budget, 0
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, blocks: torch.Tensor, scales: torch.Tensor, e: int) -> torch.Tensor:
        key = (blocks.data_ptr(), e)
        hit = self._kept.get(key)
        if hit is not None and hit[0] is blocks:
            return hit[1]
        w = dequantize_mxfp4(blocks[e], scales[e], torch.float32)
        if self.nbytes + w.nbytes <= self.budget:
            self._kept[key] = (blocks, w)
            self.nbytes += w.nbytes
        return w

    def drop(self, blocks: torch.Tensor) -> None:
        """Forget the experts of ``blocks`` (their weights were moved or rewritten)."""
        for key in [k for k, (b, _) in self._kept.items() if b is blocks]:
            self.nbytes -= self._kept.pop(key)[1].nbytes


def _convert(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor | None,
             tiles: bool = False) -> None:
    """Unpack [E, N, K/32, 16] codes into ``out`` [E, N, K] (bf16 values, or fp8 codes with ``scale_out`` per
    32-block, or per 128x128 tile with ``tiles``): the Triton kernel where it runs, else in PyTorch."""
    if convert_refusal(blocks, scales, out, scale_out) is None:
        return (convert_mxfp4_tiles if tiles else convert_mxfp4)(blocks, scales, out, scale_out)
    (_convert_tiles_torch if tiles else _convert_torch)(blocks, scales, out, scale_out)


def tile_shift(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 scales [E, N, K/32] -> (each 32-block's shift into its 128x128 tile, int32 [E, N, K/32]; the tiles'
    scale_inv, fp32 [E, ceil(N/128), ceil(K/128)]). A tile's scale is 2^(m - 133) for its largest scale byte m
    (2^(m-127) / 64), and a block of scale byte s holds its E2M1 values times 2^(s - m + 6): at most 6 * 64 =
    384, and exact in e4m3 while s is within 14 of m (its smallest value, 0.5 * 2^(s - m + 6), down to 2^-9);
    blocks further below round to e4m3's subnormals or zero, by less than 2^-16 of the tile's largest value. A
    0xFF (NaN) scale makes its whole tile NaN."""
    E, N, G = scales.shape
    nt, kt = -(-N // TILE), -(-G // (TILE // BLOCK))
    padded = torch.zeros(E, nt * TILE, kt * (TILE // BLOCK), dtype=torch.int32, device=scales.device)
    padded[:, :N, :G] = scales.to(torch.int32)
    m = padded.view(E, nt, TILE, kt, TILE // BLOCK).amax(dim=(2, 4))  # [E, nt, kt]
    inv = torch.ldexp(torch.ones_like(m, dtype=torch.float32), m - 133)
    inv = torch.where(m == 255, torch.full_like(inv, float("nan")), inv)
    per_block = m.repeat_interleave(TILE, 1).repeat_interleave(TILE // BLOCK, 2)[:, :N, :G]
    return scales.to(torch.int32) - per_block + 6, inv


def _convert_tiles_torch(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """Unpack [E, N, K/32, 16] codes into e4m3 ``out`` [E, N, K] with one fp32 ``scale_out`` per 128x128 tile
    [E, ceil(N/128), ceil(K/128)] (:func:`tile_shift`)."""
    shift, inv = tile_shift(scales)
    out.copy_(torch.ldexp(block_values(blocks), shift[..., None]).flatten(-2).to(out.dtype))  # [E, N, G, 32] -> K
    scale_out.copy_(inv)


def _convert_torch(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor | None) -> None:
    vals = block_values(blocks)  # [E, N, K/32, 32]
    s = scale_values(scales)  # [E, N, K/32]
    if scale_out is None:
        out.copy_((vals * s[..., None]).flatten(-2))
    else:
        out.copy_(vals.flatten(-2))  # E2M1 values are exact in E4M3
        scale_out.copy_(s)


class ExpertWorkspace:
    def __init__(self, compute: str = "auto", device: torch.device | str = "cpu", slots: int | None = None,
                 fused_rows: float = FUSED_ROWS_PER_EXPERT, fp8_activations: bool = False):
        if compute not in COMPUTE:
            raise ValueError(f"expert_compute must be one of {list(COMPUTE)}, got {compute!r}")
        self.compute, self.device, self.fused_rows = compute, torch.device(device), fused_rows
        # FP8 activations: the converted experts are FP8 with one scale per 128x128 tile (TileScaled), multiplied
        # FP8 x FP8; "auto" converts large steps into them instead of bf16
        self.tiles = converts_to_tiles(compute, fp8_activations)
        self.fp8 = compute == "fp8" or self.tiles
        self.fused = compute == "fused"  # no slots: the kernels read the packed weights
        self.num_slots = 0 if self.fused else slots or (2 if self.device.type == "cuda" else 1)
        self._slots: list[dict[str, torch.Tensor]] = [{} for _ in range(self.num_slots)]
        self._owner: list[object | None] = [None] * self.num_slots
        self._ready: list[torch.cuda.Event | None] = [None] * self.num_slots
        self._freed: list[torch.cuda.Event | None] = [None] * self.num_slots
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" and self.num_slots > 1 else None
        self.conversions = 0
        on_cpu = self.device.type == "cpu" and compute == "auto"
        self.dequantised = DequantisedExperts(CPU_DEQUANTISED_BYTES) if on_cpu else None
        for table in (fp4_lut, e4m3_pair_table, value_pair_table, e8m0_table):  # built now, before any capture
            table(self.device)

    # --- sizing --------------------------------------------------------------------------------------
    def reserve(self, layers) -> None:
        """Allocate every slot for the largest of ``layers`` up front, so memory is planned, not discovered."""
        if self.fused:
            return
        for name in ("w1", "w2"):
            shapes = [tuple(getattr(l, f"{name}_blocks").shape[:-2]) + (getattr(l, f"{name}_blocks").shape[-2] * BLOCK,)
                      for l in layers]
            if not shapes:
                continue
            shape = max(shapes, key=lambda s: s[0] * s[1] * s[2])
            for slot in self._slots:
                self._buffers(slot, name, shape)

    def _buffers(self, slot: dict, name: str, shape: tuple[int, ...]):
        numel = shape[0] * shape[1] * shape[2]
        scale_shape = ((shape[0], -(-shape[1] // TILE), -(-shape[2] // TILE)) if self.tiles
                       else (*shape[:-1], shape[-1] // BLOCK))
        scales = scale_shape[0] * scale_shape[1] * scale_shape[2]
        have = slot.get(name)
        if have is None or have.numel() < numel or (self.fp8 and slot[name + "_scale"].numel() < scales):
            dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
            slot[name] = torch.empty(max(numel, 0 if have is None else have.numel()), dtype=dtype, device=self.device)
            if self.fp8:
                slot[name + "_scale"] = torch.empty(scales, dtype=torch.float32, device=self.device)
        data = slot[name][:numel].view(shape)
        scale = slot[name + "_scale"][:scales].view(scale_shape) if self.fp8 else None
        return data, scale

    @property
    def nbytes(self) -> int:
        kept = self.dequantised.nbytes if self.dequantised is not None else 0
        return kept + sum(t.numel() * t.element_size() for slot in self._slots for t in slot.values())

    # --- use -------------------------------------------------------------------------------------------
    def reads_packed(self, rows_per_expert: float | None = None) -> bool:
        """Whether a step routing ``rows_per_expert`` rows to each expert on average (None: unknown) reads the
        packed weights rather than a converted copy."""
        return reads_packed(self.compute, rows_per_expert, self.fused_rows)

    def _fill(self, i: int, layer) -> None:
        slot = self._slots[i]
        for name in ("w1", "w2"):
            blocks, scales = getattr(layer, f"{name}_blocks"), getattr(layer, f"{name}_scales")
            data, scale = self._buffers(slot, name, (*blocks.shape[:-2], blocks.shape[-2] * BLOCK))
            _convert(blocks, scales, data, scale, self.tiles)
        self._owner[i] = layer
        self.conversions += 1

    def _view(self, i: int, layer):
        out = []
        for name in ("w1", "w2"):
            blocks = getattr(layer, f"{name}_blocks")
            data, scale = self._buffers(self._slots[i], name, (*blocks.shape[:-2], blocks.shape[-2] * BLOCK))
            if self.tiles:
                out.append(TileScaled(data, scale, fp8_activations=True))
            else:
                out.append(BlockScaled(data, scale) if scale is not None else data)
        return tuple(out)

    def acquire(self, layer, rows_per_expert: float | None = None):
        """(w1, w2) of ``layer`` for a step of ``rows_per_expert`` rows per expert: in the workspace, converted
        now or by an earlier :meth:`prefetch`, or the packed weights as they are (:meth:`reads_packed`)."""
        if self.reads_packed(rows_per_expert):
            kept = self.dequantised
            return (PackedMXFP4(layer.w1_blocks, layer.w1_scales, kept),
                    PackedMXFP4(layer.w2_blocks, layer.w2_scales, kept))
        if _capturing(self.device):  # converted in the graph every time: a replay cannot trust any slot
            i = self.conversions % self.num_slots
            self._fill(i, layer)
            self._owner[i] = self._ready[i] = None
            return self._view(i, layer)
        for i, owner in enumerate(self._owner):
            if owner is layer:
                if self._ready[i] is not None:
                    torch.cuda.current_stream(self.device).wait_event(self._ready[i])
                    self._ready[i] = None
                return self._view(i, layer)
        i = self.conversions % self.num_slots
        self._fill(i, layer)
        return self._view(i, layer)

    def forget(self, layer) -> None:
        """``layer``'s expert weights changed in place (moved between slots): drop what was kept of them."""
        self.invalidate()
        if self.dequantised is not None:
            self.dequantised.drop(layer.w1_blocks)
            self.dequantised.drop(layer.w2_blocks)

    def release(self, layer) -> None:
        """The caller has queued its last use of ``layer``'s weights (lets a prefetch reuse the slot)."""
        if self._stream is None or _capturing(self.device):
            return
        for i, owner in enumerate(self._owner):
            if owner is layer:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                self._freed[i] = ev

    def prefetch(self, layer, rows_per_expert: float | None = None) -> None:
        """Start converting ``layer`` into the slot not in use for a step of ``rows_per_expert`` rows per expert
        (CUDA only, not while capturing, not when the step reads the packed weights; else a no-op)."""
        if self._stream is None or layer is None or layer in self._owner or _capturing(self.device):
            return  # (always with ``fused``: no stream)
        if self.reads_packed(rows_per_expert):
            return
        i = self.conversions % self.num_slots
        with torch.cuda.stream(self._stream):
            if self._freed[i] is not None:
                self._stream.wait_event(self._freed[i])
            self._fill(i, layer)
            ev = torch.cuda.Event()
            ev.record(self._stream)
            self._ready[i] = ev

    def invalidate(self) -> None:
        """Forget which layer is in which slot (before every step: a graph replay may have rewritten them).

        On CUDA the current stream first joins any conversion still running on the side stream, and later
        ones wait for all work queued so far (a replay may still be reading the slots)."""
        self._owner = [None] * self.num_slots
        self._ready = [None] * self.num_slots
        self._freed = [None] * self.num_slots
        if self._stream is not None and not _capturing(self.device):
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._stream)
            self._stream.wait_stream(current)


def _capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (never on other devices)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
