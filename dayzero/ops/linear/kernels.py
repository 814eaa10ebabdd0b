"""``linear_fp32`` for the few rows of a decode step as one Triton kernel: the reference casts x to fp32 and
runs cuBLAS's fp32 GEMV (three kernels: the cast, a dot and a reduction, then a fourth for a scale); here each
program reads a tile of W's rows once for a tile of x's rows, multiplies in fp32 (no tensor cores: the products
are exact as in the reference) and writes the scaled result. Row tiles are always ``ROWS`` wide whatever the
number of rows, so a row's result does not depend on the batch it comes in. More than ``MAX_ROWS`` rows (a
prefill chunk) run the reference, where cuBLAS's GEMM is the better tool.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, tl, triton, triton_refusal

MAX_ROWS = 64
ROWS = 16  # rows of x per program
COLS = 4  # rows of W per program: N / 4 programs share the weight read (64 experts: 16 programs)

if HAS_TRITON:
    @triton.jit
    def _linear_fp32_kernel(x_ptr, w_ptr, b_ptr, y_ptr, T, N, sx, sw, sy, scale, K: tl.constexpr,
                            HAS_BIAS: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        t_ok, n_ok = t < T, n < N
        acc = tl.zeros((BT, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            k_ok = k < K
            x = tl.load(x_ptr + t[:, None].to(tl.int64) * sx + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # [BT, BK]
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * sw + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # [BN, BK]
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + t[:, None].to(tl.int64) * sy + n[None, :], acc * scale, mask=t_ok[:, None] & n_ok[None, :])


def _verify(x, weight, bias=None, scale=1.0) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    rows = x.numel() // max(x.shape[-1], 1)
    if rows > MAX_ROWS:
        return f"{rows} rows: cuBLAS's GEMM (the reference) serves more than {MAX_ROWS}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1] or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return f"x {tuple(x.shape)} and W {tuple(weight.shape)} must be [.., K] and [N, K] with contiguous K"
    if not x.is_floating_point() or weight.dtype != torch.float32:
        return "W must be fp32 and x a float tensor"
    if bias is not None and (bias.shape != (weight.shape[0],) or not bias.is_contiguous()):
        return f"the bias must be a contiguous [{weight.shape[0]}]"
    return None


@register("linear_fp32", "cuda", verifier=_verify, note="Triton, decode-sized rows (up to 64)")
def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                scale: float = 1.0) -> torch.Tensor:
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    y = torch.empty(T, N, dtype=torch.float32, device=x.device)
    if T and N:
        _linear_fp32_kernel[(triton.cdiv(N, COLS), triton.cdiv(T, ROWS))](
            x2, weight, bias if bias is not None else weight, y, T, N, x2.stride(0), weight.stride(0), y.stride(0),
            float(scale), K=K, HAS_BIAS=bias is not None, BT=ROWS, BN=COLS, BK=min(128, next_pow2(K)), num_warps=4)
    return y.view(*x.shape[:-1], N)
