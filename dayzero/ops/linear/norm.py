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
keeps each where it is faster. The fused launch is measured whatever the linear alone chose: where cuBLAS won the
plain product (KDA's 6416-row projection at one row on the H100, 12.5 us against the skinny kernel's 12.4, within
the 5% the skinny kernel must win by) the norm kernel before it still costs a launch, and the fused launch took
12.7 us against the pair's 14.5.

``rms_norm_gated_linear`` does the same for KDA's gated output norm and its output projection (``HEAD``): the norm
is per head, so each K step holds whole heads, sums each head's squares and scales it by its rstd, the norm
weight and the sigmoid of its gate before the product; measured the same way.
"""
from __future__ import annotations

import torch

from dayzero.ops.linear import kernels as K
from dayzero.ops.registry import register

_CHOICE: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the norm runs apart


def norm_skinny_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                       weight: torch.Tensor, bias: torch.Tensor | None = None, block: K.Block | None = None,
                       out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm`` then ``linear`` as one launch of the skinny kernel: (the projection [M, N], the normalised
    rows [M, K], the residual sum [M, K] (``x`` itself without a residual)). Each program sums the squares of
    the rows it reads anyway; the programs write the normalised rows and the sum in turn. A product in a higher
    precision than x's (:func:`rounded`: the router's fp32) reads the normalised rows rounded, as the ops apart."""
    (M, Kd), N = x.shape, weight.shape[0]
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    normed = torch.empty(M, Kd, dtype=x.dtype, device=x.device)
    res_out = x if residual is None else torch.empty(M, Kd, dtype=x.dtype, device=x.device)
    if M == 0:
        return y, normed, res_out
    K.launch(x, weight, y, Kd, block or K.candidates(M, N, Kd)[0], bias=bias, eps=eps,
             norm=(norm_weight, residual, normed, res_out), rounded=rounded(x, weight, out_dtype))
    return y, normed, res_out


def rounded(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    """Whether the fused product reads the normalised rows rounded to x's dtype (a first pass over the rows for
    their scale): for a weight or an output of a higher precision than x's, whose reader (the MoE router's
    ranking) should see the values the ops apart give, not the factored norm's."""
    return weight.dtype != x.dtype or (out_dtype or x.dtype) != x.dtype


def _verify_norm(x, residual, norm_weight, eps, weight, bias=None, out_dtype=None) -> str | None:
    if norm_weight is None or norm_weight.shape != (x.shape[-1],):
        return "the norm needs a weight of the rows' width"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1):
        return "the residual must be contiguous rows of x's shape and dtype"
    if norm_weight.dtype not in K.DTYPES or norm_weight.stride(0) != 1:
        return "the norm weight must be contiguous bf16, fp16 or fp32"
    why = K.refusal(x, weight, bias, out_dtype)
    if why is None and measured_choice(x, residual, norm_weight, eps, weight, bias, out_dtype) is None:
        return "the norm kernel and the linear apart are as fast or faster at this shape (measured)"
    return why


def _key(x, residual, norm_weight, weight, bias, out_dtype=None) -> tuple:
    return K._key(x, weight, bias, out_dtype, None) + (residual is not None, norm_weight.dtype)


def timings(x, residual, norm_weight, eps, weight, bias=None, out_dtype=None) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of the norm kernel then the linear's own choice (None) against the fused
    launch, on random rows of x's shape (a residual too when one is given)."""
    from dayzero.ops.norm.kernels import rms_norm

    xs = torch.randn(x.shape, device=x.device).to(x.dtype)
    rs = None if residual is None else torch.randn_like(xs)
    apart_block = K.measured_choice(xs, weight, bias, out_dtype)

    def apart(w):
        normed, _ = rms_norm(xs, norm_weight, eps, rs)
        return K.chosen_linear(normed, w, bias, out_dtype, None, apart_block)

    mma = K.tensor_cores(x.dtype, weight.dtype)
    return K.fused_timings(weight, apart,
                           lambda w, b: norm_skinny_linear(xs, rs, norm_weight, eps, w, bias, b, out_dtype),
                           K.candidates(xs.shape[0], weight.shape[0], xs.shape[1], mma))


def measured_choice(x, residual, norm_weight, eps, weight, bias=None, out_dtype=None) -> K.Block | None:
    """The block shape of the fused launch when it ran faster than the norm apart (measured at the key's first
    call, on the key's bucket of rows), else None."""
    key = _key(x, residual, norm_weight, weight, bias, out_dtype)
    xs = K.bucket_rows(x, key[0])  # the bucket's shape (timings draws its own rows)
    return K.measure_once(_CHOICE, key, x.device, lambda: K.fused_choice(
        f"rms_norm_linear {key[0]} x [{key[1]}, {key[2]}]", timings(xs, residual, norm_weight, eps, weight, bias,
                                                                                out_dtype)),
        "rms_norm_linear")


@register("rms_norm_linear", "cuda", verifier=_verify_norm,
          note="the RMSNorm inside the skinny linear kernel "
               "(1-8 rows, up to 64 on the tensor cores, where measured faster than the two apart)")
def rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None):
    return norm_skinny_linear(x, residual, norm_weight, eps, weight, bias,
                              _CHOICE[_key(x, residual, norm_weight, weight, bias, out_dtype)], out_dtype)


# --- rms_norm_gated_linear: KDA's gated output norm inside its output projection --------------------------------
_GATED: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the norm runs apart


def gated_candidates(rows: int, n: int, k: int, head: int, mma: bool = False) -> list[K.Block]:
    """:func:`kernels.candidates` with each K step holding whole heads (at least one)."""
    out = []
    for bn, bk, *rest in K.candidates(rows, n, k, mma):
        block = (bn, max(bk, head), *rest)
        if block not in out:
            out.append(block)
    return out


def gated_norm_skinny_linear(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                             weight: torch.Tensor, bias: torch.Tensor | None = None,
                             block: K.Block | None = None) -> torch.Tensor:
    """``rms_norm_gated`` over each head of x [M, H, V] then ``linear`` of the [M, H*V] rows, one launch."""
    M, H, V = x.shape
    N, Kd = weight.shape[0], H * V
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    K.launch(x, weight, y, Kd, block or gated_candidates(M, N, Kd, V)[0], bias=bias, eps=eps,
             gate=(norm_weight, gate.view(M, Kd)))
    return y


def _flat(t: torch.Tensor) -> torch.Tensor | None:
    """[M, H, V] with heads side by side and unit column stride, as [M, H*V] rows (a view); else None."""
    if t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        return None
    return t.view(t.shape[0], -1)


def _verify_gated(x, norm_weight, gate, eps, weight, bias=None) -> str | None:
    if x.dim() != 3 or gate.shape != x.shape:
        return "x and its gate must be [rows, heads, head_dim]"
    V = x.shape[2]
    if V & (V - 1) or V < 16:
        return f"head_dim {V}: the kernel takes a power of two from 16"
    if _flat(x) is None or _flat(gate) is None:
        return "x and the gate need heads side by side in each row, unit column stride"
    if norm_weight.shape != (V,) or norm_weight.stride(0) != 1 or norm_weight.dtype not in K.DTYPES:
        return "the norm weight must be contiguous [head_dim] in bf16, fp16 or fp32"
    if gate.dtype not in K.DTYPES:
        return "gate dtypes other than bf16, fp16 and fp32"
    why = K.refusal(_flat(x), weight, bias)
    if why is None and gated_choice(x, norm_weight, gate, eps, weight, bias) is None:
        return "the gated norm kernel and the linear apart are as fast or faster at this shape (measured)"
    return why


def _gated_key(x, norm_weight, gate, weight, bias) -> tuple:
    return K._key(_flat(x), weight, bias, None, None) + (x.shape[2], norm_weight.dtype, gate.dtype)


def gated_timings(x, norm_weight, gate, eps, weight, bias=None) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of the gated norm kernel then the linear's own choice (None) against the fused
    launch, on random rows and gates of x's shape."""
    from dayzero.ops.norm.kernels import rms_norm_gated

    M, H, V = x.shape
    xs = torch.randn(M, H, V, device=x.device).to(x.dtype)
    gs = torch.randn(M, H, V, device=x.device).to(gate.dtype)
    apart_block = K.measured_choice(xs.view(M, -1), weight, bias)
    return K.fused_timings(
        weight, lambda w: K.chosen_linear(rms_norm_gated(xs, norm_weight, gs, eps).view(M, -1), w, bias, None, None,
                                          apart_block),
        lambda w, b: gated_norm_skinny_linear(xs, norm_weight, gs, eps, w, bias, b),
        gated_candidates(M, weight.shape[0], H * V, V, K.tensor_cores(x.dtype, weight.dtype)))


def gated_choice(x, norm_weight, gate, eps, weight, bias=None) -> K.Block | None:
    """The fused launch's block shape when it ran faster than the gated norm apart (measured at the key's first
    call, on the key's bucket of rows), else None."""
    key = _gated_key(x, norm_weight, gate, weight, bias)
    xs = K.bucket_rows(x, key[0])
    return K.measure_once(_GATED, key, x.device, lambda: K.fused_choice(
        f"rms_norm_gated_linear {key[0]} x [{key[1]}, {key[2]}]", gated_timings(xs, norm_weight, gate, eps, weight,
                                                                             bias)), "rms_norm_gated_linear")


@register("rms_norm_gated_linear", "cuda", verifier=_verify_gated,
          note="the gated head norm inside the skinny linear kernel "
               "(1-8 rows, up to 64 on the tensor cores, where measured faster than apart)")
def rms_norm_gated_linear(x: torch.Tensor, norm_weight: torch.Tensor, gate: torch.Tensor, eps: float,
                          weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return gated_norm_skinny_linear(x, norm_weight, gate, eps, weight, bias,
                                    _GATED[_gated_key(x, norm_weight, gate, weight, bias)])
