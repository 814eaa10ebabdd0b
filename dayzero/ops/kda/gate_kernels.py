"""The KDA / Gated DeltaNet forget gate as one elementwise Triton kernel (the reference issues about eight):
``-exp(A_log) * softplus(f + dt_bias)``, or with ``lower_bound`` ``lower_bound * sigmoid(exp(A_log) * (f +
dt_bias))``, fp32 out. Same math as ``reference.kda_gate``."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, pdl, tl, triton, triton_refusal

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency, softplus

if HAS_TRITON:
    @triton.jit
    def _gate_kernel(f_ptr, a_ptr, b_ptr, g_ptr, n, H, K, sft, lower,
                     LOWER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        hk = i % (H * K)
        t = i // (H * K)
        x = tl.load(f_ptr + t * sft + hk, mask=m, other=0.0).to(tl.float32)
        x += tl.load(b_ptr + hk, mask=m, other=0.0).to(tl.float32)
        a = tl.exp(tl.load(a_ptr + hk // K, mask=m, other=0.0).to(tl.float32))
        if LOWER:
            g = lower * tl.sigmoid(a * x)
        else:
            g = -a * softplus(x)
        tl.store(g_ptr + i, g, mask=m)


def _verify(f, A_log, dt_bias, lower_bound=None) -> str | None:
    why = triton_refusal(f)
    if why is not None:
        return why
    T, H, K = f.shape
    if f.stride(2) != 1 or f.stride(1) != K or A_log.numel() != H or dt_bias.numel() != H * K:
        return "f must be [T, H, K] with contiguous heads, A_log H values and dt_bias H*K"
    if not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        return "A_log and dt_bias must be contiguous"
    return None


@register("kda_gate", "cuda", verifier=_verify, note="Triton")
def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None):
    # f: [T, H, K]; A_log: [H] (any shape with H elements); dt_bias: [H*K] -> g [T, H, K] fp32
    T, H, K = f.shape
    g = torch.empty(T, H, K, dtype=torch.float32, device=f.device)
    n = g.numel()
    if n:
        block = 1024
        _gate_kernel[(triton.cdiv(n, block),)](f, A_log, dt_bias, g, n, H, K, f.stride(0),
                                               float(lower_bound or 0.0), LOWER=lower_bound is not None,
                                               BLOCK=block, num_warps=4, **pdl(f))
    return g
