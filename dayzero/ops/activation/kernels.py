"""The gated activations as Triton kernels, and the dense MLP on the device built on them.

``silu_and_mul`` / ``swiglu_oai`` read ``[gate | up]`` rows and write the [.., I] product in one pass (the
references issue six to ten kernels); ``relu2`` likewise. The dense ``mlp`` runs its two projections as bf16
GEMMs (the reference multiplies in fp32, which on a GPU first copies the whole weight to fp32 on every call)
with the activation between them: h is rounded to the activations' dtype before the second GEMM, as every
bf16 engine does.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import call, register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, rows_view, tl, triton, triton_refusal

SILU, RELU2, SWIGLU_OAI = 0, 1, 2

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _act_kernel(x_ptr, y_ptr, n_cols, sx, limit, alpha,
                    KIND: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
        grid_dependency(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < n_cols
        a = tl.load(x_ptr + row * sx + cols, mask=m, other=0.0).to(tl.float32)
        up = a
        if GATED:
            up = tl.load(x_ptr + row * sx + n_cols + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * n_cols + cols, activate(a, up, limit, alpha, KIND, CLAMP).to(y_ptr.dtype.element_ty),
                 mask=m)

    @triton.jit
    def activate(a, up, limit, alpha, KIND: tl.constexpr, CLAMP: tl.constexpr):
        """The activation of fp32 ``a`` (the gate, or the input of squared ReLU) and ``up`` (unused by squared
        ReLU), clamped at ``limit`` first when CLAMP; the kernels of the linear ops apply it too."""
        if KIND == 1:  # RELU2
            y = tl.maximum(a, 0.0)
            return y * y
        if CLAMP:
            a = tl.minimum(a, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        if KIND == 0:  # SILU
            return a * tl.sigmoid(a) * up
        return a * tl.sigmoid(alpha * a) * (up + 1.0)  # SWIGLU_OAI


    @triton.jit
    def _sigmoid_gate_kernel(x_ptr, g_ptr, y_ptr, HV, V, s_gt, s_gh, s_gc, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Row t of x [T, H*V] times sigmoid of its gate: head h = c // V reads gate column (c % V) * s_gc
        (s_gc = 0 for one gate per head)."""
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < HV
        x = tl.load(x_ptr + t * HV + c, mask=m, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t * s_gt + (c // V) * s_gh + (c % V) * s_gc, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * HV + c, (x * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=m)


def _refusal(x: torch.Tensor, gated: bool) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    if gated and x.shape[-1] % 2:
        return f"a gated activation needs an even last dim [gate | up], got {tuple(x.shape)}"
    if rows_view(x) is None:
        return "the rows cannot be viewed as [N, C] without a copy (channels not contiguous)"
    return None


def act(x: torch.Tensor, kind: int, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """``act(x)`` over the last dim: x [..., 2I] for the gated kinds, [..., I] for relu2 -> [..., I]."""
    gated = kind != RELU2
    C = x.shape[-1] // 2 if gated else x.shape[-1]
    x2 = rows_view(x)
    y = torch.empty((*x.shape[:-1], C), dtype=x.dtype, device=x.device)
    if x2.shape[0] and C:
        block = min(1024, next_pow2(C))
        _act_kernel[(x2.shape[0], triton.cdiv(C, block))](
            x2, y, C, x2.stride(0), float(limit if limit is not None else 0.0), float(alpha), KIND=kind,
            GATED=gated, CLAMP=limit is not None, BLOCK=block, num_warps=4, **pdl(x2))
    return y


@register("silu_and_mul", "cuda", verifier=lambda x, limit=None: _refusal(x, True), note="Triton")
def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    return act(x, SILU, limit)


@register("relu2", "cuda", verifier=lambda x: _refusal(x, False), note="Triton")
def relu2(x: torch.Tensor) -> torch.Tensor:
    return act(x, RELU2)


@register("swiglu_oai", "cuda", verifier=lambda x, alpha=1.702, limit=7.0: _refusal(x, True), note="Triton")
def swiglu_oai(x: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    return act(x, SWIGLU_OAI, limit, alpha)


KINDS = {"silu": SILU, "relu2": RELU2, "swiglu_oai": SWIGLU_OAI}


def _verify_mlp(x, w1, w2, activation="silu", limit=None) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dtype not in (torch.bfloat16, torch.float16) or w1.dtype != x.dtype or w2.dtype != x.dtype:
        return "the device MLP takes bf16/fp16 activations and weights of the same dtype (fp32 runs the reference)"
    if activation not in KINDS:
        return f"unknown activation {activation!r}"
    return None


@register("mlp", "cuda", verifier=_verify_mlp, note="bf16 GEMMs around the Triton activation")
def dense_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str = "silu",
              limit: float | None = None) -> torch.Tensor:
    # x: [..., D]; w1: [r*I, D]; w2: [D, I] -> [..., D]
    kind = KINDS[activation]
    rows = 1 if kind == RELU2 else 2
    if w1.shape[0] != rows * w2.shape[1] or w1.shape[1] != w2.shape[0]:
        raise ValueError(f"activation {activation!r} needs w1 [{rows}*I, D] and w2 [D, I]; "
                         f"got w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    if kind == SWIGLU_OAI and limit is None:
        limit = 7.0
    # the GEMMs through the linear ops: a decode step's few rows may take the skinny kernel, the activation inside
    # the second
    return call("act_linear", call("linear", x, w1), w2, None, activation, limit)


def _gate_refusal(x: torch.Tensor, gate: torch.Tensor) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.dim() != 3 or gate.dim() != 3 or gate.shape[:2] != x.shape[:2] or gate.shape[2] not in (1, x.shape[2]):
        return f"x [T, H, V] with a gate [T, H, V] or [T, H, 1], got {tuple(x.shape)} and {tuple(gate.shape)}"
    if not x.is_contiguous():
        return "x must be contiguous"
    return None


@register("sigmoid_gate", "cuda", verifier=_gate_refusal, note="Triton, the gate read through its strides")
def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    T, H, V = x.shape
    y = torch.empty_like(x)
    if x.numel():
        per_channel = gate.shape[2] == V and V > 1
        block = min(1024, next_pow2(H * V))
        _sigmoid_gate_kernel[(T, triton.cdiv(H * V, block))](
            x, gate, y, H * V, V, gate.stride(0), gate.stride(1), gate.stride(2) if per_channel else 0,
            BLOCK=block, num_warps=4, **pdl(x))
    return y
