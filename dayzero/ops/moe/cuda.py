"""Routed experts on CUDA: each projection is ONE grouped GEMM over every expert (torch's ``grouped_mm``, a
CUTLASS kernel on sm80+) instead of the reference's GEMM pair per expert hit, and nothing waits on the host.

The math is the reference's (``moe_experts``): pairs sorted by expert, ``w2 · act(w1 · x + b1) + b2`` per
pair, weighted and summed per token in fp32. The GEMMs take bf16 inputs and accumulate in fp32 but return
bf16 (the only output dtype torch 2.11's kernel gives), and the second reads the activation rounded to bf16,
where the reference keeps both fp32: differences of the order of bf16 rounding. Calls it cannot take fall back to
the reference with the reason: fp32 or fp8 weights, packed or tile-scaled experts, widths not a multiple of 8.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.moe.reference import _activation
from dayzero.ops.registry import register

ALIGN = 8  # elements: the kernel wants 16-byte aligned rows


def _verify(x, ids, weights, w1, w2, activation="silu", b1=None, b2=None, limit=None) -> str | None:
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no grouped_mm"
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) < (8, 0):
        return "grouped_mm needs a CUDA device of compute capability 8.0 or newer"
    if x.dtype != torch.bfloat16 or any(not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 for w in (w1, w2)):
        return "grouped_mm takes bf16 activations and plain bf16 expert weights"
    if any(d % ALIGN for d in (*w1.shape[1:], w2.shape[-1])):
        return f"expert widths {tuple(w1.shape[1:])} / {w2.shape[-1]} are not multiples of {ALIGN}"
    return None


@register("moe_experts", "cuda", verifier=_verify, note="one grouped GEMM per projection (torch grouped_mm)")
def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                    activation: str = "silu", b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    limit: float | None = None) -> torch.Tensor:
    # x: [T, D] bf16; ids, weights: [T, k]; w1: [E, r*I, D]; w2: [E, D, I]
    act = _activation(activation, w1, w2, limit)
    T, D = x.shape
    E, k = w1.shape[0], ids.shape[1]
    flat = ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token, expert = order // k, flat[order]
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)  # [E] end of each expert's rows
    h = F.grouped_mm(x[token], w1.transpose(1, 2), offs=offs).float()  # [T*k, r*I]
    if b1 is not None:
        h = h + b1.float()[expert]
    y = F.grouped_mm(act(h).to(torch.bfloat16), w2.transpose(1, 2), offs=offs).float()  # [T*k, D]
    if b2 is not None:
        y = y + b2.float()[expert]
    out = torch.zeros(T, D, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, y * weights.reshape(-1).float()[order, None])
    return out.to(x.dtype)
