"""RMSNorm (with the residual add fused), the gated RMSNorm and LayerNorm as Triton kernels: one launch per call where
the PyTorch reference issues six to twelve (casts, square, mean, rsqrt, products). Same math as
``reference.py``: the residual sum rounded once to the input's dtype, then normalised in fp32.

Rows are the flattened leading dims; each program normalises ``ROWS`` rows of up to ``BLOCK`` channels held
in registers, so a row wider than :data:`MAX_WIDTH` is refused (the reference runs it).
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, rows_view as _rows, tl, triton, triton_refusal

MAX_WIDTH = 16384

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, n_rows, D, sx, sr, eps,
                         HAS_RES: tl.constexpr, HAS_W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        grid_dependency(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        r64 = rows[:, None].to(tl.int64)
        x = tl.load(x_ptr + r64 * sx + cols[None, :], mask=mask, other=0.0)
        out = r64 * D + cols[None, :]
        if HAS_RES:
            res = tl.load(r_ptr + r64 * sr + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + res.to(tl.float32)).to(ro_ptr.dtype.element_ty)
            tl.store(ro_ptr + out, x, mask=mask)
        h = x.to(tl.float32)
        y = h * tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, y_ptr, n_rows, D, sx, sg, eps,
                               ROWS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        r64 = rows[:, None].to(tl.int64)
        h = tl.load(x_ptr + r64 * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + r64 * sg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        y = h * tl.rsqrt(tl.sum(h * h, axis=1) / D + eps)[:, None] * w * tl.sigmoid(g)
        tl.store(y_ptr + r64 * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, n_rows, D, sx, eps,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr):
        grid_dependency(PDL)
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < D)
        r64 = rows[:, None].to(tl.int64)
        h = tl.load(x_ptr + r64 * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(h, axis=1) / D
        d = tl.where(mask, h - mean[:, None], 0.0)
        y = d * tl.rsqrt(tl.sum(d * d, axis=1) / D + eps)[:, None]
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + r64 * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch_shape(n_rows: int, D: int) -> tuple[int, int, int, int]:
    """(grid, rows per program, block width, warps): about 4K elements per program."""
    block = next_pow2(D)
    rows = max(1, min(64, 4096 // block))
    warps = 8 if block >= 4096 else 4
    return triton.cdiv(n_rows, rows), rows, block, warps


def _refusal(x: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    why = triton_refusal(x)
    if why is not None:
        return why
    if x.shape[-1] > MAX_WIDTH:
        return f"rows of {x.shape[-1]} channels are wider than the kernel's {MAX_WIDTH}"
    if any(o is not None and _rows(o) is None for o in (x, *others)):
        return "an operand's rows are not contiguous"
    return None


def _verify_rms(x, weight, eps, residual=None) -> str | None:
    return _refusal(x, residual)


@register("rms_norm", "cuda", verifier=_verify_rms, note="Triton, residual add fused")
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [..., D]; weight: [D] -> (y, residual_out) as the reference
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else x
    r2 = _rows(residual) if residual is not None else x2
    n = x2.shape[0]
    if n:
        grid, rows, block, warps = _launch_shape(n, D)
        _rms_norm_kernel[(grid,)](x2, r2, weight if weight is not None else x2, y, res_out, n, D,
                                  x2.stride(0), r2.stride(0), float(eps), HAS_RES=residual is not None,
                                  HAS_W=weight is not None, ROWS=rows, BLOCK=block, num_warps=warps, **pdl(x2))
    return y, res_out


@register("rms_norm_gated", "cuda", verifier=lambda x, weight, gate, eps: _refusal(x, gate), note="Triton")
def rms_norm_gated(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate: [..., V]; weight: [V] -> RMSNorm(x) * weight * sigmoid(gate)
    D = x.shape[-1]
    x2, g2 = _rows(x), _rows(gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if n:
        grid, rows, block, warps = _launch_shape(n, D)
        _rms_norm_gated_kernel[(grid,)](x2, g2, weight, y, n, D, x2.stride(0), g2.stride(0), float(eps),
                                        ROWS=rows, BLOCK=block, num_warps=warps, **pdl(x2))
    return y


@register("layer_norm", "cuda", verifier=lambda x, weight, bias, eps: _refusal(x), note="Triton")
def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    # x: [..., D]; weight, bias: [D] or None -> LayerNorm over the last dim (biased variance)
    D = x.shape[-1]
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x2.shape[0]
    if n:
        grid, rows, block, warps = _launch_shape(n, D)
        _layer_norm_kernel[(grid,)](x2, weight if weight is not None else x2, bias if bias is not None else x2, y,
                                    n, D, x2.stride(0), float(eps), HAS_W=weight is not None,
                                    HAS_B=bias is not None, ROWS=rows, BLOCK=block, num_warps=warps, **pdl(x2))
    return y
