"""Where the Triton kernels can run, and what they need to know about it.

Triton is optional: without it (or on a device it cannot compile for) every op keeps its PyTorch path.
On the CPU the kernels run through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is
imported; the test suite does that on machines without a GPU, so every kernel is checked in CI at tiny shapes.

The interpreter multiplies bf16 and fp16 operands of ``tl.dot`` wrongly (it hands their raw bits to numpy),
so kernels take a ``DOT_F32`` constexpr (:data:`DOT_F32`) and upcast the operands of their dots when it is set:
on a GPU it is False and the dots run on the tensor cores in the operands' own dtype.

On Hopper and later GPUs the kernels are launched with programmatic dependent launch (:func:`pdl`): a kernel may
be scheduled while the one before it in the stream is still running, and its first statement,
:func:`grid_dependency`, waits for that one to finish and its writes to be visible, then lets the next kernel be
scheduled in turn. A decode step of ~300 kernels of a few microseconds each hides most of the launch and ramp-up
between them that way (inside CUDA graphs too: capture keeps the programmatic edges). ``DAYZERO_PDL=0`` turns it
off.
"""
from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the optional kernels are simply not offered
    triton = tl = None

HAS_TRITON = triton is not None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAS_GDC = True
except ImportError:  # a Triton without grid dependency control: every launch keeps full stream order
    HAS_GDC = False

if HAS_TRITON:
    @triton.jit
    def softplus(x):
        """log(1 + e^x) in fp32, x itself above 20 (torch's threshold)."""
        return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))

    @triton.jit
    def softmax_out(acc, m, l, sink_ptr, heads, ok, HAS_SINK: tl.constexpr):
        """The attention output ``acc`` [M, D] of an online softmax with running max ``m`` (log2 units) and sum
        ``l`` [M], divided by its denominator; with a sink, ``e^sink[heads]`` joins the denominator only. A row
        with no key and no sink gets 0."""
        if HAS_SINK:
            sink = tl.load(sink_ptr + heads, mask=ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2 units
            m_all = tl.maximum(m, sink)
        else:
            m_all = m
        m_all = tl.where(m_all == float("-inf"), 0.0, m_all)
        wgt = tl.exp2(m - m_all)
        denom = l * wgt
        if HAS_SINK:
            denom += tl.exp2(sink - m_all)
        return acc * (wgt / tl.maximum(denom, 1.1754943508222875e-38))[:, None]

    @triton.jit
    def round_e4m3(z):
        """fp32 z (|z| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic: Triton's
        interpreter casts fp32 to e4m3 without carrying a rounded-up mantissa into the exponent (31.9 becomes 16),
        so kernels that cast under it round first and the cast only changes the type."""
        e = tl.maximum(((z.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # |z|'s exponent, e4m3's least
        ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits: steps of 2^(e-3)
        inv = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # powers of two: both products are exact
        return ((z * inv + 12582912.0) - 12582912.0) * ulp  # 1.5 * 2^23: an fp32 add rounds to an integer, ties even
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DOT_F32 = INTERPRET

if HAS_TRITON and INTERPRET:
    def grid_dependency(PDL):
        """Nothing to wait for: the interpreter runs each launch to its end before the next (a plain function,
        since calling a jit function costs the interpreter as much as a small kernel's whole program)."""
elif HAS_TRITON:
    @triton.jit
    def grid_dependency(PDL: tl.constexpr):
        """The first statement of every kernel launched with :func:`pdl`'s options, in every program and before
        any load or store: wait until the kernel before this one has finished and its writes are visible (so
        no program may return before it, or a kernel with nothing to do could finish ahead of its predecessor
        and release the next one early), then let the next kernel be scheduled."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()


_PDL_DEVICES: dict[int, bool] = {}


def pdl(t: torch.Tensor) -> dict:
    """Launch options of a kernel whose tensors live on ``t``'s device: ``PDL`` (the constexpr its
    :func:`grid_dependency` takes) and Triton's ``launch_pdl``, on for CUDA devices of compute capability 9.0 or
    more, off elsewhere (the interpreter, older GPUs, a Triton without it) or when ``DAYZERO_PDL=0``."""
    if t.device.type != "cuda" or INTERPRET or not HAS_GDC or os.environ.get("DAYZERO_PDL", "1") == "0":
        return {"PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    on = _PDL_DEVICES.get(index)
    if on is None:
        on = _PDL_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


_JUDGED_AS: str | None = None  # while set, CPU tensors are judged as if on this device type (see judged_as)


@contextlib.contextmanager
def judged_as(device_type: str):
    """Answer :func:`triton_refusal` for CPU tensors as for ``device_type``: ``dayzero ops --platform cuda`` on a
    machine without a GPU probes the model on CPU tensors and reports what a GPU would run."""
    global _JUDGED_AS
    prev, _JUDGED_AS = _JUDGED_AS, device_type
    try:
        yield
    finally:
        _JUDGED_AS = prev


def triton_refusal(t: torch.Tensor) -> str | None:
    """Why a Triton kernel cannot run on ``t``'s device, or None when it can."""
    if not HAS_TRITON:
        return "triton is not installed"
    kind = _JUDGED_AS if _JUDGED_AS is not None and t.device.type == "cpu" else t.device.type
    if kind == "cuda":
        return None
    if kind == "cpu" and INTERPRET:
        return None
    return f"Triton kernels run on CUDA devices (or on the CPU with TRITON_INTERPRET=1), not on {kind}"


def rows_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as [rows, C] without a copy (its last dim contiguous), or None when its layout does not allow it."""
    if t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        return None


def paged_pool_refusal(pool, what: str, quantised: bool = False) -> str | None:
    """Why a Triton kernel cannot read the paged pool ``pool`` ([num_blocks, block_size, width] of ``what``
    rows), or None: other dtypes, and fp32 pools on a GPU (the kernels' fp32 IEEE dots spill registers there)
    are left to the PyTorch paths. Quantised pools (fp8 / int8 codes) are read by kernels that take ``quantised``
    ones, with one scale per token row (:func:`pool_operands`); per-channel scales are not."""
    if not isinstance(pool, torch.Tensor):
        if not quantised:
            return f"quantised {what} pools are read by the PyTorch path"
        if getattr(pool, "per_channel", True) or len(getattr(pool, "row", ())) != 1:
            return f"quantised {what} pools with per-channel scales are read by the PyTorch path"
        data, scale = pool.data, pool.scale
        if data.stride(-1) != 1 or scale.stride(-1) != 1 or scale.shape != data.shape[:2]:
            return f"the quantised {what} pool's codes and per-token scales must have contiguous rows"
        if pool.out_dtype == torch.float32 and data.device.type == "cuda":
            return f"quantised {what} pools of an fp32 model: the kernel's fp32 (IEEE) dots spill registers on the GPU"
        return None
    if pool.dim() != 3 or pool.stride(-1) != 1:
        return f"the {what} pool must be [num_blocks, block_size, width] with contiguous rows"
    if pool.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{what} pool dtype {pool.dtype} is not bf16, fp16 or fp32"
    if pool.dtype == torch.float32 and pool.device.type == "cuda":
        return f"fp32 {what} pools: the kernel's fp32 (IEEE) dots spill registers on the GPU; the PyTorch path runs them"
    return None


def pool_operands(pool) -> tuple[torch.Tensor, torch.Tensor, bool, torch.dtype]:
    """(rows [num_blocks, block_size, width], per-token scales [num_blocks, block_size], quantised, the dtype the
    rows are read in) of a plain or quantised paged pool (:func:`paged_pool_refusal` with ``quantised`` passed):
    a plain pool's scales are the pool itself, never read. The scale of a quantised row factors out of every dot
    with it, so kernels multiply the codes (exact in bf16) and scale the products."""
    if isinstance(pool, torch.Tensor):
        return pool, pool, False, pool.dtype
    return pool.data, pool.scale, True, pool.out_dtype


if HAS_TRITON:
    TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
