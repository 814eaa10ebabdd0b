"""``moe_experts_grouped`` in Triton: two grouped GEMM kernels over every expert's rows, no host sync.

Kernel 1 computes ``h = act(xs @ w1[e]^T + b1[e])`` with the activation in its epilogue (gated activations
keep a gate and an up accumulator, so h is [N, I], never [N, 2I]); kernel 2 computes ``y = h @ w2[e]^T +
b2[e]``. h is stored in ``xs.dtype`` between them (bf16 on a GPU, as on the grouped_mm path), where the
reference keeps it fp32: differences of the order of bf16 rounding. Accumulation is fp32; y is in xs.dtype.

The tile schedule is derived from ``offsets`` inside the kernels (``triton_moe_kernels``); the grid is the
bound ``cdiv(N, BLOCK_M) + min(E, N)`` row tiles times the column tiles, from shapes alone, so the op runs
inside CUDA-graph capture and a replay with other offsets is correct. Weights are read as stored: plain
tensors, ``TileScaled`` / ``BlockScaled`` FP8 and ``PackedMXFP4``, dequantised in the K loop; ``TileScaled``
weights with ``fp8_activations`` multiply activations quantised to e4m3 per row and 128-wide K step, on FP8
tensor cores.

Block sizes come from ``triton_moe_configs.json`` (written by ``benchmarks/moe_layer.py --tune``, keyed by
weight format, E, L, I and a row-count bucket, read once) or else from a heuristic on rows per expert.
Nothing is tuned inside the op: it may be running under graph capture.
"""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from dayzero.ops.triton_support import DOT_F32, HAS_TRITON, next_pow2, pdl, triton_refusal
from dayzero.quant.fp8 import TILE, TileScaled, takes_fp8_activations
from dayzero.quant.mxfp4 import BLOCK
from dayzero.quant.workspace import BlockScaled, PackedMXFP4

if HAS_TRITON:
    from dayzero.ops.moe import triton_moe_kernels as K

CONFIGS = Path(__file__).with_name("triton_moe_configs.json")
ACTIVATIONS = ("silu", "relu2", "swiglu_oai")
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_EXPERTS = 4096  # the schedule holds every expert's offset in registers


@dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # row tiles that run across all column tiles together (L2 reuse)

    def __post_init__(self):
        if any(b < 16 or b & (b - 1) for b in (self.block_m, self.block_n, self.block_k)):
            raise ValueError(f"block sizes must be powers of two >= 16 (tl.dot), got {self}")


@dataclass(frozen=True)
class Config:
    up: KernelConfig  # kernel 1 (w1 + activation)
    down: KernelConfig  # kernel 2 (w2)


def default_config(rows: int, num_experts: int, gated: bool = True) -> Config:
    """Block sizes by rows per expert (routing assumed even): small tiles and long K steps when few rows
    hit each expert (weight-bandwidth bound), bigger row tiles when there are many (compute bound)."""
    m = rows / max(num_experts, 1)
    if m <= 16:
        up = down = KernelConfig(16, 64, 128, 4, 4)
    elif m <= 32:
        up = down = KernelConfig(32, 64, 128, 4, 4)
    elif m <= 96:
        up, down = KernelConfig(64, 64 if gated else 128, 64, 4, 3), KernelConfig(64, 128, 64, 4, 3)
    else:  # two fp32 accumulators of a gated tile: keep BLOCK_N at 64
        up, down = KernelConfig(128, 64 if gated else 128, 64, 8, 3), KernelConfig(128, 128, 64, 8, 3)
    return Config(up, down)


def row_bucket(rows: int) -> int:
    return next_pow2(max(rows, 1))


def table_key(fmt: str, num_experts: int, L: int, I: int) -> str:
    return f"{fmt},E{num_experts},L{L},I{I}"


@functools.lru_cache(maxsize=8)
def device_name(device: torch.device) -> str:
    """The name the tuning table records its device by: the GPU's model name, or "cpu" (asked once per device,
    not on every expert call)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=4)
def _table(device: str) -> dict:
    """The tuning table {key: {bucket: {"up": [BM, BN, BK, warps, stages], "down": [...]}}}, read once per device
    name; empty unless it was tuned on that device model (another GPU may lack the shared memory its tiles need)."""
    try:
        table = json.loads(CONFIGS.read_text())
    except (OSError, ValueError):
        return {}
    return table.get("configs", {}) if table.get("device") == device else {}


# fp32 (the exact-comparison mode): one config whatever the row count, so a row's result does not depend on how
# many other rows the step has (a decode step padded to a captured graph's size gives the eager step's output)
FP32_CONFIG = Config(KernelConfig(16, 64, 32, 4, 2), KernelConfig(16, 64, 32, 4, 2))


def config_for(fmt: str, rows: int, num_experts: int, L: int, I: int, gated: bool = True,
               dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Config:
    """The config tuned on this ``device`` model for the nearest row bucket of this format and shape, else
    :func:`default_config`."""
    if dtype == torch.float32:
        return FP32_CONFIG
    entry = _table(device).get(table_key(fmt, num_experts, L, I))
    if not entry:
        return default_config(rows, num_experts, gated)
    b = math.log2(row_bucket(rows))
    c = entry[min(entry, key=lambda k: abs(math.log2(int(k)) - b))]
    return Config(KernelConfig(*c["up"]), KernelConfig(*c["down"]))


# ---------------------------------------------------------------- weight formats

def weight_format(w) -> str | None:
    """Name of the stored format of stacked expert weights (the tuning table's key), None if unknown."""
    if isinstance(w, TileScaled):  # with FP8 activations a kernel of its own (FP8 x FP8 dots): its own tiles
        return "fp8_tile_a8" if w.fp8_activations else "fp8_tile"
    if isinstance(w, BlockScaled):
        return "fp8_block"
    if isinstance(w, PackedMXFP4):
        return "mxfp4"
    if isinstance(w, torch.Tensor):
        return str(w.dtype).removeprefix("torch.")
    return None


def format_key(w1, w2) -> str:
    f1, f2 = weight_format(w1), weight_format(w2)
    return f1 if f1 == f2 else f"{f1}+{f2}"


def _tensors(w) -> tuple[torch.Tensor, ...]:
    if isinstance(w, TileScaled):
        return w.data, w.scale_inv
    if isinstance(w, BlockScaled):
        return w.data, w.scale
    if isinstance(w, PackedMXFP4):
        return w.blocks, w.scales
    return (w,)


def _weight_refusal(name: str, w, shape: tuple[int, int, int], device: torch.device) -> str | None:
    """Why the kernels cannot read expert weights ``w`` of logical shape ``shape`` [E, n, k]."""
    if tuple(w.shape) != shape:
        return f"{name} is {tuple(w.shape)}, expected {shape}"
    if any(t.device != device for t in _tensors(w)):
        return f"{name} is not on {device}"
    E, n, k = shape
    if isinstance(w, torch.Tensor):
        return None if w.dtype in PLAIN_DTYPES else f"{name} of dtype {w.dtype} is not bf16, fp16 or fp32"
    if isinstance(w, PackedMXFP4):
        if w.blocks.dtype != torch.uint8 or w.scales.dtype != torch.uint8:
            return f"MXFP4 {name} must be uint8 blocks and scales"
        if w.blocks.stride(-1) != 1 or w.blocks.stride(-2) != BLOCK // 2:
            return f"MXFP4 {name} blocks must be contiguous within each row"
        return None
    if w.data.dtype != torch.float8_e4m3fn or w.data.stride(-1) != 1:
        return f"FP8 {name} must be float8_e4m3fn with contiguous rows"
    if isinstance(w, TileScaled):
        want = (E, -(-n // TILE), -(-k // TILE))
        if tuple(w.scale_inv.shape) != want or w.scale_inv.dtype != torch.float32:
            return f"TileScaled {name} scale_inv must be fp32 {want}, got {tuple(w.scale_inv.shape)}"
        return None
    if k % BLOCK or tuple(w.scale.shape) != (E, n, k // BLOCK) or w.scale.dtype != torch.float32:
        return f"BlockScaled {name} scale must be fp32 {(E, n, k // BLOCK)}, got {tuple(w.scale.shape)}"
    return None


def refusal(xs, offsets, w1, w2, activation: str = "silu", b1=None, b2=None, limit=None, order=None) -> str | None:
    """Why the Triton expert kernels cannot run these rows (or tokens read through ``order``) and weights, or None
    when they can (``offsets`` None: the weights and rows only)."""
    why = triton_refusal(xs)
    if why is not None:
        return why
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not one of {ACTIVATIONS}"
    if limit is not None and activation != "silu":
        return f"a clamp limit applies to 'silu' only, not {activation!r}"
    cap = torch.cuda.get_device_capability(xs.device) if xs.device.type == "cuda" else None
    if cap is not None and cap < (8, 0):
        return f"the Triton expert kernels need compute capability 8.0 or newer (bf16 dots), the device has {cap[0]}.{cap[1]}"
    if cap is not None and cap < (8, 9) and (takes_fp8_activations(w1) or takes_fp8_activations(w2)):
        return f"FP8 activations need FP8 tensor cores (compute capability 8.9 or newer), the device has {cap[0]}.{cap[1]}"
    if xs.dim() != 2 or xs.dtype not in PLAIN_DTYPES:
        return f"xs must be [N, L] in bf16, fp16 or fp32, got {tuple(xs.shape)} {xs.dtype}"
    for name, w in (("w1", w1), ("w2", w2)):
        if weight_format(w) is None:
            return f"{name} of type {type(w).__name__} is no weight format the Triton kernels read"
    if len(w1.shape) != 3 or len(w2.shape) != 3:
        return f"w1 and w2 must be stacked [E, n, k], got {tuple(w1.shape)} and {tuple(w2.shape)}"
    (N, L), E, I = xs.shape, w1.shape[0], w2.shape[-1]
    if not 0 < E <= MAX_EXPERTS:
        return f"{E} experts: the schedule takes 1 to {MAX_EXPERTS}"
    if order is not None and (order.dim() != 1 or order.device != xs.device or order.is_floating_point()):
        return f"order must be a 1-D integer tensor on {xs.device}, got {order.dtype} {tuple(order.shape)}"
    bad = offsets is not None and (offsets.shape != (E,) or offsets.dtype not in (torch.int32, torch.int64)
                                   or offsets.device != xs.device)
    if bad:
        return f"offsets must be int32 [{E}] on {xs.device}, got {offsets.dtype} {tuple(offsets.shape)}"
    r = 1 if activation == "relu2" else 2
    for name, w, shape in (("w1", w1, (E, r * I, L)), ("w2", w2, (E, L, I))):
        why = _weight_refusal(name, w, shape, xs.device)
        if why is not None:
            return why
    for name, b, shape in (("b1", b1, (E, r * I)), ("b2", b2, (E, L))):
        if b is not None and (tuple(b.shape) != shape or b.device != xs.device):
            return f"{name} must be {shape} on {xs.device}, got {tuple(b.shape)}"
    return None


# ---------------------------------------------------------------- launch

def weight_operand(w):
    """(format code, data, scale, data strides [e, n, k], scale strides [e, n, k-block]) for the kernels."""
    if isinstance(w, TileScaled):
        return K.TILE.value, w.data, w.scale_inv, w.data.stride(), w.scale_inv.stride()
    if isinstance(w, BlockScaled):
        return K.BLOCK.value, w.data, w.scale, w.data.stride(), w.scale.stride()
    if isinstance(w, PackedMXFP4):  # bytes of a row are contiguous: k-byte stride 1 (checked by refusal)
        return K.MXFP4.value, w.blocks, w.scales, (*w.blocks.stride()[:2], 1), w.scales.stride()
    return K.PLAIN.value, w, w, w.stride(), (0, 0, 0)


def _fit(c: KernelConfig, fmt: int, act_fp8: bool = False) -> KernelConfig:
    """Clamp BLOCK_K to what a format needs: whole 32-blocks (BLOCK, MXFP4), within one 128-tile (TILE), exactly
    one 128-wide activation group (FP8 activations)."""
    if act_fp8:
        bk = TILE
    elif fmt == K.TILE.value:
        bk = min(c.block_k, TILE)
    else:
        bk = max(c.block_k, BLOCK) if fmt != K.PLAIN.value else c.block_k
    return KernelConfig(c.block_m, c.block_n, bk, c.num_warps, c.num_stages, c.group_m)


def row_tiles(rows: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the row tiles of any routing: each non-empty expert wastes less than one tile."""
    return -(-rows // block_m) + min(num_experts, rows)


def new_buffer(rows: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    """Output and scratch buffers of the expert kernels, grouped and direct (tests replace this to fill them with
    NaN: nothing may read what no kernel wrote)."""
    return torch.empty(rows, cols, dtype=like.dtype, device=like.device)


def moe_experts_grouped(xs: torch.Tensor, offsets: torch.Tensor, w1, w2, activation: str = "silu",
                        b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                        limit: float | None = None, config: Config | None = None, order: torch.Tensor | None = None,
                        top_k: int = 1) -> torch.Tensor:
    """``ys[r] = w2_e · act(w1_e · xs[r] + b1_e) + b2_e`` for rows sorted by expert; padding rows come out 0.
    With ``order``, xs holds the tokens and the first kernel reads sorted row r from token ``order[r] // top_k``
    (no gathered copy of the rows).

    Call only when :func:`refusal` is None. ``config`` overrides the block sizes (tests, tuning)."""
    # xs: [N, L] (or [T, L] with order [N]); offsets: [E] int32 row ends; w1: [E, r*I, L]; w2: [E, L, I] -> [N, L]
    L, E, I = xs.shape[1], w1.shape[0], w2.shape[-1]
    N = xs.shape[0] if order is None else order.shape[0]
    y = new_buffer(N, L, xs)
    if N == 0:
        return y
    gated = activation != "relu2"
    cfg = config or config_for(format_key(w1, w2), N, E, L, I, gated, xs.dtype, device_name(xs.device))
    h = new_buffer(N, I, xs)  # [N, I]: rounded to xs.dtype between the kernels
    offsets = offsets.contiguous()
    common = dict(E_POW2=next_pow2(E), DOT_F32=DOT_F32, PRECISION="ieee" if xs.dtype == torch.float32 else None)
    act = {"silu": K.SILU, "relu2": K.RELU2, "swiglu_oai": K.SWIGLU_OAI}[activation].value

    a1, a2 = takes_fp8_activations(w1), takes_fp8_activations(w2)
    x, sx = quantize_groups(xs) if a1 else (xs, xs)
    fmt, data, scale, st, ss = weight_operand(w1)
    c = _fit(cfg.up, fmt, a1)
    m_tiles = row_tiles(N, E, c.block_m)
    K.moe_up_kernel[(m_tiles * -(-I // c.block_n),)](
        x, sx, offsets if order is None else order, offsets, data, scale, xs if b1 is None else b1, h,
        0.0 if limit is None else float(limit), N, m_tiles, L, I, E,
        *x.stride(), sx.stride(0), *st, *ss, *((0, 0) if b1 is None else b1.stride()), h.stride(0),
        FMT=fmt, ACT=act, GATED=gated, HAS_BIAS=b1 is not None, HAS_LIMIT=limit is not None,
        GATHER=order is not None, TOP_K=top_k,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, num_warps=c.num_warps,
        num_stages=c.num_stages, ACT_FP8=a1, **common, **pdl(xs))

    hq, sh = quantize_groups(h) if a2 else (h, h)
    fmt, data, scale, st, ss = weight_operand(w2)
    c = _fit(cfg.down, fmt, a2)
    m_tiles = row_tiles(N, E, c.block_m)
    K.moe_down_kernel[(m_tiles * -(-L // c.block_n),)](
        hq, sh, offsets, data, scale, h if b2 is None else b2, y, N, m_tiles, L, I, E,
        hq.stride(0), sh.stride(0), *st, *ss, *((0, 0) if b2 is None else b2.stride()), y.stride(0),
        FMT=fmt, HAS_BIAS=b2 is not None, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        GROUP_M=c.group_m, num_warps=c.num_warps, num_stages=c.num_stages, ACT_FP8=a2, **common, **pdl(h))
    return y


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [R, K] as e4m3 codes [R, K] and fp32 scales [R, cdiv(K, 128)], one per row per 128 columns
    (``quantize_activations``' rounding): the FP8 activations the grouped GEMMs read."""
    R, Kdim = x.shape
    q = torch.empty(R, Kdim, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R, -(-Kdim // TILE), dtype=torch.float32, device=x.device)
    if R:
        block_r = 32
        K.quantize_groups_kernel[(-(-R // block_r), s.shape[1])](
            x, q, s, R, Kdim, *x.stride(), q.stride(0), s.stride(0), BLOCK_R=block_r, ROUND_FIRST=DOT_F32,
            num_warps=4, **pdl(x))
    return q, s
