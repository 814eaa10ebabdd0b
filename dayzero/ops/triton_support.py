"""Where the Triton kernels can run, and what they need to know about it.

Triton is optional: without it (or on a device it cannot compile for) every op keeps its PyTorch path.
On the CPU the kernels run through Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is
imported; the test suite does that on machines without a GPU, so every kernel is checked in CI at tiny shapes.

The interpreter multiplies bf16 and fp16 operands of ``tl.dot`` wrongly (it hands their raw bits to numpy),
so kernels take a ``DOT_F32`` constexpr (:data:`DOT_F32`) and upcast the operands of their dots when it is set:
on a GPU it is False and the dots run on the tensor cores in the operands' own dtype.
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
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DOT_F32 = INTERPRET


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


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
