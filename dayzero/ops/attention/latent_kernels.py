"""``mla_latent_write`` and ``indexer_key_write`` as one Triton kernel each (see
:mod:`dayzero.ops.attention.latent`): one program per token normalises its row, rotates its rope channels and
writes the result into its slot's row of the pool. ``mla_step_rows`` runs both writes and the rotary of the
query heads' rope channels in one launch: three programs per token, one for each part (a DSA layer's decode
step had them as three launches of ~1.7 us each, each waiting for the one before)."""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.rotary.kernels import refusal as rotary_refusal
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton, triton_refusal

MAX_WIDTH = 16384  # the compressed KV a program holds

if HAS_TRITON:
    from dayzero.ops.rotary.kernels import rotate_heads
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _latent_write_kernel(c_ptr, w_ptr, k_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, R, half, s_c, s_k, s_cos,
                             W, eps, ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BR: tl.constexpr,
                             BH: tl.constexpr, PDL: tl.constexpr):
        # c: [T, R], k: [T, 2·half] (unit channel strides); pool rows of W = R + 2·half at slot[t]; grid: T
        grid_dependency(PDL)
        latent_row(tl.program_id(0).to(tl.int64), c_ptr, w_ptr, k_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, R, half,
                   s_c, s_k, s_cos, W, eps, ROPE, INTERLEAVED, BR, BH)

    @triton.jit
    def latent_row(t, c_ptr, w_ptr, k_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, R, half, s_c, s_k, s_cos, W, eps,
                   ROPE: tl.constexpr, INTERLEAVED: tl.constexpr, BR: tl.constexpr, BH: tl.constexpr):
        """Token t's latent row, normed and rotated, written at its slot (the program of either kernel)."""
        row = pool_ptr + tl.load(slot_ptr + t).to(tl.int64) * W
        r = tl.arange(0, BR)
        x = tl.load(c_ptr + t * s_c + r, mask=r < R, other=0.0)
        h = x.to(tl.float32)
        y = h * tl.rsqrt(tl.sum(h * h, axis=0) / R + eps) * tl.load(w_ptr + r, mask=r < R, other=0.0).to(tl.float32)
        tl.store(row + r, y.to(x.dtype).to(pool_ptr.dtype.element_ty), mask=r < R)
        i = tl.arange(0, BH)
        ok = i < half
        if INTERLEAVED:
            a, b = 2 * i, 2 * i + 1
        else:
            a, b = i, i + half
        x1 = tl.load(k_ptr + t * s_k + a, mask=ok, other=0.0)
        x2 = tl.load(k_ptr + t * s_k + b, mask=ok, other=0.0)
        if ROPE:
            c = tl.load(cos_ptr + t * s_cos + i, mask=ok, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + t * s_cos + i, mask=ok, other=0.0).to(tl.float32)
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            x1, x2 = (f1 * c - f2 * s).to(x1.dtype), (f2 * c + f1 * s).to(x1.dtype)
        tl.store(row + R + a, x1.to(pool_ptr.dtype.element_ty), mask=ok)
        tl.store(row + R + b, x2.to(pool_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _index_key_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, D, start, half, s_k, s_cos,
                          eps, INTERLEAVED: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
        # k: [T, D] (unit channel stride) -> LayerNorm, channels start .. start + 2·half rotated, pool row slot[t]
        grid_dependency(PDL)
        index_key_row(tl.program_id(0).to(tl.int64), k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, D,
                      start, half, s_k, s_cos, eps, INTERLEAVED, BD, BH)

    @triton.jit
    def index_key_row(t, k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, D, start, half, s_k, s_cos, eps,
                      INTERLEAVED: tl.constexpr, BD: tl.constexpr, BH: tl.constexpr):
        """Token t's indexer key, normed and rotated, written at its slot (the program of either kernel)."""
        row = pool_ptr + tl.load(slot_ptr + t).to(tl.int64) * D
        src = k_ptr + t * s_k
        d = tl.arange(0, BD)
        x = tl.load(src + d, mask=d < D, other=0.0)
        h = x.to(tl.float32)
        mean = tl.sum(h, axis=0) / D
        diff = tl.where(d < D, h - mean, 0.0)
        rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / D + eps)
        y = diff * rstd * tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32) \
            + tl.load(b_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        rotated = (d >= start) & (d < start + 2 * half)
        tl.store(row + d, y.to(x.dtype).to(pool_ptr.dtype.element_ty), mask=(d < D) & ~rotated)
        # the rotated pairs: their normed values again (the same arithmetic), then the rotation
        i = tl.arange(0, BH)
        ok = i < half
        if INTERLEAVED:
            a, b = start + 2 * i, start + 2 * i + 1
        else:
            a, b = start + i, start + i + half
        ya = _normed(src, w_ptr, b_ptr, a, ok, mean, rstd).to(x.dtype).to(tl.float32)
        yb = _normed(src, w_ptr, b_ptr, b, ok, mean, rstd).to(x.dtype).to(tl.float32)
        c = tl.load(cos_ptr + t * s_cos + i, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * s_cos + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(row + a, (ya * c - yb * s).to(x.dtype).to(pool_ptr.dtype.element_ty), mask=ok)
        tl.store(row + b, (yb * c + ya * s).to(x.dtype).to(pool_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _normed(src, w_ptr, b_ptr, j, ok, mean, rstd):
        """LayerNorm of channels j of a row whose mean and rstd are known, in fp32."""
        h = tl.load(src + j, mask=ok, other=0.0).to(tl.float32)
        return (h - mean) * rstd * tl.load(w_ptr + j, mask=ok, other=0.0).to(tl.float32) \
            + tl.load(b_ptr + j, mask=ok, other=0.0).to(tl.float32)

    @triton.jit
    def _step_rows_kernel(q_ptr, qo_ptr, H, s_qt, s_qh, c_ptr, w_ptr, k_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, R,
                          half, s_c, s_k, s_cos, W, eps, ik_ptr, iw_ptr, ib_ptr, icos_ptr, isin_ptr, ipool_ptr, D,
                          istart, ihalf, s_ik, s_icos, ieps, INTERLEAVED: tl.constexpr, BR: tl.constexpr,
                          BH: tl.constexpr, BQH: tl.constexpr, I_INTERLEAVED: tl.constexpr, BD: tl.constexpr,
                          BIH: tl.constexpr, PDL: tl.constexpr):
        # grid: T x (2, or 3 with the indexer's key): token t's rotated query heads, its latent row, its indexer key
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        if part == 0:
            rotate_heads(t, tl.arange(0, BQH), q_ptr, cos_ptr, sin_ptr, qo_ptr, H, half, s_qt, s_qh, s_cos, 2 * half,
                         0, INTERLEAVED, BH, 0)
        elif part == 1:
            latent_row(t, c_ptr, w_ptr, k_ptr, cos_ptr, sin_ptr, pool_ptr, slot_ptr, R, half, s_c, s_k, s_cos, W, eps,
                       True, INTERLEAVED, BR, BH)
        else:
            index_key_row(t, ik_ptr, iw_ptr, ib_ptr, icos_ptr, isin_ptr, ipool_ptr, slot_ptr, D, istart, ihalf, s_ik,
                          s_icos, ieps, I_INTERLEAVED, BD, BIH)


def _pool_refusal(x: torch.Tensor, pool, width: int, what: str) -> str | None:
    """Why the kernel cannot write rows of ``width`` from ``x``'s device into ``pool``, or None."""
    why = triton_refusal(x)
    if why is not None:
        return why
    if not isinstance(pool, torch.Tensor):
        return f"quantised (or functional) {what} pools are written by the reference"
    if pool.dim() != 3 or not pool.is_contiguous() or pool.shape[-1] != width:
        return f"the {what} pool must be a contiguous [blocks, block_size, {width}]"
    return None


def _refusal(c_kv, weight, eps, k_pe, cos, sin, interleaved, pool, slots) -> str | None:
    R, P = c_kv.shape[-1], k_pe.shape[-1]
    why = _pool_refusal(c_kv, pool, R + P, "latent")
    if why is not None:
        return why
    if R > MAX_WIDTH or P % 2 or c_kv.dim() != 2 or k_pe.dim() != 2 or c_kv.stride(-1) != 1 or k_pe.stride(-1) != 1:
        return "c_kv [T, R <= 16384] and k_pe [T, P even] need contiguous channels"
    if cos is not None and (2 * cos.shape[-1] != P or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        return "cos and sin must be [T, P/2] tables with contiguous columns"
    if c_kv.dtype != k_pe.dtype:
        return "c_kv and k_pe must share a dtype"
    return None


@register("mla_latent_write", "cuda", verifier=_refusal, note="Triton, one launch for norm, rope and the write")
def mla_latent_write(c_kv: torch.Tensor, weight: torch.Tensor, eps: float, k_pe: torch.Tensor,
                     cos: torch.Tensor | None, sin: torch.Tensor | None, interleaved: bool, pool: torch.Tensor,
                     slots: torch.Tensor) -> None:
    T, (R, P) = c_kv.shape[0], (c_kv.shape[-1], k_pe.shape[-1])
    if T:
        rope = cos is not None
        _latent_write_kernel[(T,)](c_kv, weight, k_pe, cos if rope else c_kv, sin if rope else c_kv, pool, slots,
                                   R, P // 2, c_kv.stride(0), k_pe.stride(0), cos.stride(0) if rope else 0, R + P,
                                   float(eps), ROPE=rope, INTERLEAVED=interleaved, BR=next_pow2(R),
                                   BH=next_pow2(max(1, P // 2)), num_warps=4 if R <= 2048 else 8, **pdl(c_kv))


def _index_refusal(k, weight, bias, eps, cos, sin, interleaved, start, pool, slots) -> str | None:
    D, half = k.shape[-1], cos.shape[-1]
    why = _pool_refusal(k, pool, D, "indexer-key")
    if why is not None:
        return why
    first = 0 if start is None else start
    if k.dim() != 2 or k.stride(-1) != 1 or D > MAX_WIDTH or first + 2 * half > D or (start is None and 2 * half != D):
        return "k must be [T, D <= 16384] with contiguous channels, the rotated channels inside it"
    if weight is None or bias is None or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return "a LayerNorm with weight and bias, and [T, half] cos / sin tables with contiguous columns"
    return None


@register("indexer_key_write", "cuda", verifier=_index_refusal, note="Triton, one launch for norm, rope and the write")
def indexer_key_write(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, cos: torch.Tensor,
                      sin: torch.Tensor, interleaved: bool, start: int | None, pool: torch.Tensor,
                      slots: torch.Tensor) -> None:
    T, D = k.shape
    if T:
        half = cos.shape[-1]
        _index_key_kernel[(T,)](k, weight, bias, cos, sin, pool, slots, D, start or 0, half, k.stride(0),
                                cos.stride(0), float(eps), INTERLEAVED=interleaved, BD=next_pow2(D),
                                BH=next_pow2(half), num_warps=4, **pdl(k))


def _step_refusal(q_pe, c_kv, weight, eps, k_pe, cos, sin, interleaved, pool, slots, index=None) -> str | None:
    if cos is None or q_pe.shape[-1] != k_pe.shape[-1]:
        return "the query's rope channels and the latent's rope key turn by the same rotary"
    why = _refusal(c_kv, weight, eps, k_pe, cos, sin, interleaved, pool, slots) or rotary_refusal(q_pe, cos, sin)
    if why is None and index is not None:
        why = _index_refusal(*index[:8], index[8], slots)
    return why


@register("mla_step_rows", "cuda", verifier=_step_refusal,
          note="Triton, one launch for the query's rotary, the latent row and the indexer key")
def mla_step_rows(q_pe: torch.Tensor, c_kv: torch.Tensor, weight: torch.Tensor, eps: float, k_pe: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, pool: torch.Tensor, slots: torch.Tensor,
                  index: tuple | None = None) -> torch.Tensor:
    T, H, P = q_pe.shape
    R = c_kv.shape[-1]
    q = torch.empty((T, H, P), dtype=q_pe.dtype, device=q_pe.device)
    if T:
        k, iw, ib, ieps, icos, isin, i_inter, start, ipool = index if index is not None else (
            c_kv, weight, weight, 0.0, cos, sin, False, 0, pool)
        D = k.shape[-1]
        _step_rows_kernel[(T, 2 if index is None else 3)](
            q_pe, q, H, q_pe.stride(0), q_pe.stride(1), c_kv, weight, k_pe, cos, sin, pool, slots, R, P // 2,
            c_kv.stride(0), k_pe.stride(0), cos.stride(0), R + P, float(eps), k, iw, ib, icos, isin, ipool, D,
            start or 0, icos.shape[-1], k.stride(0), icos.stride(0), float(ieps), INTERLEAVED=interleaved,
            BR=next_pow2(R), BH=next_pow2(max(1, P // 2)), BQH=next_pow2(H), I_INTERLEAVED=i_inter,
            BD=next_pow2(D), BIH=next_pow2(icos.shape[-1]), num_warps=4 if R <= 2048 else 8, **pdl(q_pe))
    return q
