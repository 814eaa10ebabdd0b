"""``rms_norm_linear`` on a GPU: a layer's input RMSNorm run inside its first projection's skinny kernel
(``kernels._skinny_kernel`` with ``NORM``), one launch where a decode step ran two.

The norm's scale is a per-row factor, so each program sums the squares of the input rows as it streams them
through the product and multiplies its outputs by ``rsqrt(mean + eps)`` at the end; the norm weight multiplies
the rows as they are read. Program 0 also writes the normalised rows and the residual sum for the layer's other
readers (the MoE router, the DSA indexer). The product reads the normalised rows in fp32 where the two ops apart
round them to the model dtype first (the difference is that rounding).

Whether it runs is measured, like the linear's own choice: at a key's first eager call, the fused launch at each
block shape against the norm kernel followed by the linear's measured choice, each replayed from a CUDA graph
over L2-cold weight copies. On the H200 the norm inside the 2048 -> 1536 LatentMoE projection took 4.5 us where
the pair took 6.5, and inside KDA's 2048 -> 6416 projection 12-14 us where the pair took 12: the measurement
keeps each where it is faster.
"""
from __future__ import annotations

import logging

import torch

from dayzero.ops.linear import kernels as K
from dayzero.ops.registry import register
from dayzero.ops.triton_support import next_pow2, triton

log = logging.getLogger("dayzero.ops")

_CHOICE: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the norm runs apart


def norm_skinny_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None,
                       block: K.Block | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` then ``linear`` as one launch of the skinny kernel: (the projection [M, N], the normalised
    rows [M, K], the residual sum [M, K] (``x`` itself without a residual)). Each program sums the squares of
    the rows it reads anyway; program 0 writes the normalised rows and the sum."""
    (M, Kd), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    normed = torch.empty(M, Kd, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty(M, Kd, dtype=x.dtype, device=x.device)
    if M == 0:
        return y, normed, res_out
    bn, bk, warps = block or K.candidates(M, N, Kd)[0]
    K._skinny_kernel[(triton.cdiv(N, bn),)](
        x, weight, weight if bias is None else bias, y, y, M, N, Kd, x.stride(0), weight.stride(0), 0, y.stride(0),
        x if residual is None else residual, norm_weight, normed, res_out,
        0 if residual is None else residual.stride(0), float(eps), 0.0, 0.0,
        HAS_BIAS=bias is not None, HAS_ADD=False, NORM=True, HAS_RES=residual is not None, ACT=0, CLAMP=False,
        EVEN_K=Kd % bk == 0,
        BLOCK_M=next_pow2(M), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return y, normed, res_out


def _verify_norm(x, residual, norm_weight, eps, weight, bias=None) -> str | None:
    if norm_weight is None or norm_weight.shape != (x.shape[-1],):
        return "the norm needs a weight of the rows' width"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        return "the residual must be contiguous rows of x's shape and dtype"
    if norm_weight.dtype not in K.DTYPES or norm_weight.stride(0) != 1:
        return "the norm weight must be contiguous bf16, fp16 or fp32"
    why = K._verify(x, weight, bias)
    if why is None and measured_choice(x, residual, norm_weight, eps, weight, bias) is None:
        return "the norm kernel and the linear apart are as fast or faster at this shape (measured)"
    return why


def _key(x, residual, norm_weight, weight, bias) -> tuple:
    return K._key(x, weight, bias, None, None) + (residual is not None, norm_weight.dtype)


def measured_choice(x, residual, norm_weight, eps, weight, bias=None) -> K.Block | None:
    """The block shape of the fused launch when it ran faster than the norm apart (measured at the key's first
    call, after the linear's own choice), else None."""
    key = _key(x, residual, norm_weight, weight, bias)

    def measure() -> K.Block | None:
        from dayzero.ops.norm.kernels import rms_norm

        xs = torch.randn(key[0], x.shape[1], device=x.device).to(x.dtype)  # the bucket's rows, random
        rs = None if residual is None else torch.randn_like(xs)
        apart_block = K._CHOICE[K._key(xs, weight, bias, None, None)]  # the linear's own, measured before
        ws = K.cold_copies(weight)

        def apart(w):
            normed, _ = rms_norm(xs, norm_weight, eps, rs)
            return K.chosen_linear(normed, w, bias, None, None, apart_block)

        times = {None: K.graph_time([lambda w=w: apart(w) for w in ws])}
        for b in K.candidates(xs.shape[0], weight.shape[0], xs.shape[1]):
            times[b] = K.graph_time([lambda w=w, b=b: norm_skinny_linear(xs, rs, norm_weight, eps, w, bias, b)
                                     for w in ws])
        best = K.fastest_triton(times)
        choice = best if times[best] < times[None] else None
        log.info("rms_norm_linear %d x [%d, %d]: apart %.1f us, fused %s %.1f us -> %s", key[0], key[1], key[2],
                 1e3 * times[None], best, 1e3 * times[best], choice or "apart")
        return choice

    return K.measure_once(_CHOICE, key, x.device, measure)


@register("rms_norm_linear", "cuda", verifier=_verify_norm,
          note="the RMSNorm inside the skinny linear kernel (1-8 rows, where measured faster than the two apart)")
def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None):
    return norm_skinny_linear(x, residual, norm_weight, eps, weight, bias,
                              _CHOICE[_key(x, residual, norm_weight, weight, bias)])
