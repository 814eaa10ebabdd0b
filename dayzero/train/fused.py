"""The training forward's fused kernels: fla-core's Triton kernels, each with its backward, in place of the
references' chains of fp32 elementwise ops (the ``train`` platform).

A training step of the default model moves ~100K tokens; every reference op upcasts its [T, C] input to fp32 and
runs a few elementwise kernels over it, and autograd runs as many again backward. A profile of one step on an
H100 put half of its GPU time there (the causal conv's shifted taps alone about a quarter). Here each is one
kernel forward and one backward:

- ``causal_conv1d_pooled``: fla's varlen causal conv over the packed rows (``cu_seqlens``: each sequence from a
  zero window), SiLU inside;
- ``silu_and_mul``: fla's SwiGLU over the ``[gate | up]`` halves (MoE experts, dense MLPs, shared experts);
- ``rms_norm``: fla's RMSNorm with the residual add fused (``prenorm``: the sum comes back for the next layer);
- ``rms_norm_gated``: fla's RMSNorm with the sigmoid output gate (KDA's output norm);
- the routed experts (``moe_experts_grouped``, :mod:`dayzero.train.routing`): one ``torch._grouped_mm`` a
  projection over the rows sorted by expert, where the batched GEMMs padded every expert to the largest one's
  count, which the host had to read back (a synchronisation in every MoE layer). It runs where a probe on the
  device and dtype (forward and backward of a tiny grouped GEMM against plain matmuls) passes.

fla's ``chunk_kda`` can also compute the KDA gate and beta's sigmoid inside; that option is not used yet: in a
bf16 step of the default model the ``A_log`` gradients of the fused and reference paths differed by 20-25% with
it and without it alike (one scalar a head, summing the whole step's gate gradients), so its own effect was not
separated.

Each falls back to the reference where fla-core is absent, on tensors off CUDA, or on arguments the kernel does
not take (a clamp limit, a norm without weight). :func:`mode` sets where they run: ``auto`` (CUDA tensors),
``off`` (nowhere: the previous path, for side-by-side timing; ``DAYZERO_TRAIN_FUSED=0`` at start) or ``on``
(CPU tensors too, through Triton's interpreter: the tests).
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

from dayzero.ops.activation.reference import silu_and_mul
from dayzero.ops.norm.reference import rms_norm, rms_norm_gated
from dayzero.ops.registry import register
from dayzero.ops.fla_import import limit_fla_autotuning, quiet_fla_import

try:  # fla-core (optional): Triton kernels with a backward
    with quiet_fla_import():
        from fla.modules.activations import swiglu as fla_swiglu
        from fla.modules.causal_conv1d import causal_conv1d as fla_causal_conv1d
        from fla.modules.norm.fused_norm_gate import rms_norm_gated as fla_rms_norm_gated
        from fla.modules.norm.layernorm import rms_norm as fla_rms_norm
except Exception:  # noqa: BLE001 - absent, or a triton it cannot use: the references run
    fla_swiglu = fla_causal_conv1d = fla_rms_norm_gated = fla_rms_norm = None

MODES = ("auto", "off", "on")
_MODE = "off" if os.environ.get("DAYZERO_TRAIN_FUSED", "1") == "0" else "auto"


@contextlib.contextmanager
def mode(m: str):
    """Within the block the fused kernels run per ``m``: ``auto`` (CUDA tensors), ``off`` or ``on``."""
    global _MODE
    if m not in MODES:
        raise ValueError(f"fused kernel mode must be one of {MODES}, got {m!r}")
    prev, _MODE = _MODE, m
    try:
        yield
    finally:
        _MODE = prev


def _runs_on(t: torch.Tensor) -> bool:
    """Whether the mode lets the fused paths run on ``t``'s device."""
    return _MODE == "on" or (_MODE == "auto" and t.is_cuda)


def ready(t: torch.Tensor) -> bool:
    """Whether fla's fused kernels run on ``t`` now (fla's autotuning cut on the first use)."""
    if fla_causal_conv1d is None or not _runs_on(t):
        return False
    limit_fla_autotuning()
    return True


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, batch, activation: str | None) -> torch.Tensor:
    """[T, C] rows of the batch's sequences, each from a zero window -> [T, C] in x.dtype (weight [C, W])."""
    cu_host = getattr(batch, "cu_seqlens_cpu", None)
    y, _ = fla_causal_conv1d(x[None], weight.contiguous(), activation=activation, cu_seqlens=batch.cu_seqlens,
                             cu_seqlens_cpu=cu_host)
    return y[0]


@register("silu_and_mul", "train", note="fla-core's SwiGLU kernel (CUDA), else the reference")
def silu_and_mul_train(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    # x: [..., 2I] -> [..., I]
    if limit is not None or x.shape[-1] % 2 or not ready(x):
        return silu_and_mul(x, limit)
    gate, up = x.chunk(2, dim=-1)
    return fla_swiglu(gate, up)


_GROUPED_MM: dict[tuple, bool] = {}  # (device, dtype) -> the probe's verdict


def grouped_mm_ready(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the experts run as grouped GEMMs on ``x``'s device in ``dtype`` (the mode allows it, bf16 on CUDA,
    and the probe passed there)."""
    if not hasattr(torch, "_grouped_mm") or not _runs_on(x) or (x.is_cuda and dtype != torch.bfloat16):
        return False
    key = (str(x.device), dtype)
    if key not in _GROUPED_MM:
        _GROUPED_MM[key] = _probe_grouped_mm(x.device, dtype)
    return _GROUPED_MM[key]


def _probe_grouped_mm(device, dtype) -> bool:
    """A grouped GEMM of groups of 5, 0 and 11 rows, forward and backward, against plain matmuls."""
    g = torch.Generator().manual_seed(0)
    try:  # whatever mode the first call comes in: gradients on, no autocast
        with torch.inference_mode(False), torch.enable_grad(), torch.autocast(torch.device(device).type, enabled=False):
            x = torch.randn(16, 32, generator=g).to(device, dtype).requires_grad_()
            w = torch.randn(3, 48, 32, generator=g).to(device, dtype).requires_grad_()
            ends = torch.tensor([5, 5, 16], device=device, dtype=torch.int32)
            y = torch._grouped_mm(x, w.transpose(1, 2), offs=ends)
            y.float().square().sum().backward()
            ref = torch.cat((x[:5] @ w[0].T, x[5:] @ w[2].T)).float()
            ok = bool(torch.allclose(y.float(), ref, atol=0.1, rtol=0.05)) and bool(w.grad[1].eq(0).all())
    except Exception as exc:  # noqa: BLE001 - an unsupported device, dtype or layout: the padded GEMMs run
        logging.getLogger(__name__).warning("grouped GEMM unavailable on %s %s (%s): padded batched GEMMs",
                                            device, dtype, str(exc).splitlines()[0][:120])
        return False
    if not ok:
        logging.getLogger(__name__).warning("grouped GEMM on %s %s disagrees with matmul: padded batched GEMMs",
                                            device, dtype)
    return ok


# fla's norm kernels take cdiv(rows, 2048) as a compile-time constant: every step's row count would compile them
# again (seconds each); rows padded to a multiple of ROWS_GRANULE keep the variants few
ROWS_GRANULE = 1 << 15


def _padded_rows(*xs: torch.Tensor) -> tuple[int, list[torch.Tensor]]:
    """[N, D] tensors -> (N, each padded with zero rows to a multiple of ``ROWS_GRANULE`` when N exceeds it)."""
    n = xs[0].shape[0]
    pad = -n % ROWS_GRANULE if n > ROWS_GRANULE else 0
    return n, [torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x for x in xs]


@register("rms_norm", "train", note="fla-core's RMSNorm with the residual add fused (CUDA), else the reference")
def rms_norm_train(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., D]; weight: [D] -> (y, the residual sum) in x.dtype
    if weight is None or not ready(x):
        return rms_norm(x, weight, eps, residual)
    shape, D = x.shape, x.shape[-1]
    if residual is None:
        n, (rows,) = _padded_rows(x.reshape(-1, D))
        return fla_rms_norm(rows, weight, None, eps=eps)[:n].view(shape), x
    n, (rows, res) = _padded_rows(x.reshape(-1, D), residual.to(x.dtype).reshape(-1, D))
    y, summed = fla_rms_norm(rows, weight, None, residual=res, eps=eps, prenorm=True)
    return y[:n].view(shape), summed[:n].view(shape)


@register("rms_norm_gated", "train", note="fla-core's RMSNorm with the sigmoid gate (CUDA), else the reference")
def rms_norm_gated_train(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate: [..., V]; weight: [V] -> RMSNorm(x) * weight * sigmoid(gate) in x.dtype
    if not ready(x):
        return rms_norm_gated(x, weight, gate, eps)
    V = x.shape[-1]
    n, (rows, g) = _padded_rows(x.reshape(-1, V), gate.to(x.dtype).reshape(-1, V))
    return fla_rms_norm_gated(rows, g, weight, None, activation="sigmoid", eps=eps)[:n].view(x.shape)
