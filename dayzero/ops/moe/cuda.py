"""Routed experts on CUDA without a host synchronisation, so the MoE block can be captured in a CUDA graph.

``moe_experts_grouped`` takes the rows ``moe_permute`` sorted by expert. When Triton can run them
(``triton_moe.refusal`` is None) it runs the Triton grouped-expert kernels: two launches over every expert,
the activation fused into the first, and plain, FP8 (``TileScaled``, ``BlockScaled``) or packed MXFP4
(``PackedMXFP4``) weights read as stored. Otherwise, for bf16 activations and plain bf16 weights with widths
that are multiples of 8, each projection runs as ONE grouped GEMM over every expert (torch's ``grouped_mm``,
a CUTLASS kernel on sm80+) instead of the reference's GEMM pair per expert.
The GEMMs accumulate in fp32 but return bf16 (the only output dtype torch 2.11's kernel gives), and the
second reads the activation rounded to bf16, where the reference keeps both fp32: differences of the order
of bf16 rounding.

Everything else (fp32 weights, block-FP8 ``TileScaled`` experts, the ``BlockScaled`` FP8 workspace, packed
MXFP4, widths grouped_mm cannot take) runs :func:`masked_grouped_mlp`: every expert over all N rows with fixed shapes,
keeping the rows that are its own. It costs E times the FLOPs of the rows, but never reads the offsets
on the host, where the reference's loop over experts must.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from dayzero.ops.moe import direct_kernels, permute_kernels, triton_moe, unpermute_kernels
from dayzero.ops.moe.reference import _activation, _mlp, permute, unpermute
from dayzero.ops.registry import call, register
from dayzero.quant.fp8 import TileScaled, takes_fp8_activations
from dayzero.quant.workspace import BlockScaled, PackedMXFP4

log = logging.getLogger("dayzero.ops")

ALIGN = 8  # elements: the kernel wants 16-byte aligned rows
_LOGGED: set[str] = set()


def expert_of_rows(offsets: torch.Tensor, n: int) -> torch.Tensor:
    """Expert of each of ``n`` sorted rows, on the device; rows past ``offsets[-1]`` get E (no expert)."""
    # offsets: [E] int32 row ends -> [n] int64
    return torch.searchsorted(offsets, torch.arange(n, device=offsets.device, dtype=offsets.dtype), right=True)


def grouped_mm_refusal(xs, w1, w2) -> str | None:
    """Why torch's grouped_mm cannot run these rows and weights, or None when it can."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no grouped_mm"
    if xs.device.type != "cuda" or torch.cuda.get_device_capability(xs.device) < (8, 0):
        return "grouped_mm needs a CUDA device of compute capability 8.0 or newer"
    if xs.dtype != torch.bfloat16 or any(not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 for w in (w1, w2)):
        return "grouped_mm takes bf16 activations and plain bf16 expert weights"
    if any(d % ALIGN for d in (*w1.shape[1:], w2.shape[-1])):
        return f"expert widths {tuple(w1.shape[1:])} / {w2.shape[-1]} are not multiples of {ALIGN}"
    return None


def grouped_mm_mlp(xs: torch.Tensor, offsets: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   activation: str = "silu", b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   limit: float | None = None) -> torch.Tensor:
    """The grouped-GEMM path: one ``grouped_mm`` per projection over every expert's rows."""
    # xs: [N, L] bf16 rows in expert order; offsets: [E] int32; w1: [E, r*I, L]; w2: [E, L, I]
    act = _activation(activation, w1, w2, limit)
    N = xs.shape[0]
    if N == 0:
        return xs.new_zeros(0, w2.shape[-2])
    expert = expert_of_rows(offsets, N) if b1 is not None or b2 is not None else None
    h = F.grouped_mm(xs, w1.transpose(1, 2), offs=offsets).float()  # [N, r*I]
    if b1 is not None:
        h = h + b1.float()[expert]
    y = F.grouped_mm(act(h).to(torch.bfloat16), w2.transpose(1, 2), offs=offsets).float()  # [N, L]
    if b2 is not None:
        y = y + b2.float()[expert]
    return y.to(xs.dtype)


def masked_grouped_mlp(xs: torch.Tensor, offsets: torch.Tensor, w1, w2, activation: str = "silu",
                       b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                       limit: float | None = None) -> torch.Tensor:
    """The sync-free fallback: each expert over all rows, kept where the row is that expert's (fp32 math)."""
    # xs: [N, L] rows in expert order; offsets: [E] int32; w1: [E, r*I, L]; w2: [E, L, I] (or indexable by e)
    act = _activation(activation, w1, w2, limit)
    E, N = w1.shape[0], xs.shape[0]
    expert = expert_of_rows(offsets, N)[:, None]  # [N, 1]
    x = xs.float()
    ys = torch.zeros(N, w2.shape[-2], dtype=torch.float32, device=xs.device)  # [N, L]
    for e in range(E):
        y = _mlp(x, w1[e], w2[e], act, None if b1 is None else b1[e], None if b2 is None else b2[e],
                 takes_fp8_activations(w1), takes_fp8_activations(w2))
        ys = torch.where(expert == e, y, ys)  # where, not a product: other experts' rows may overflow here
    return ys.to(xs.dtype)


def _verify(xs, offsets, w1, w2, *args, **kwargs) -> str | None:
    known = (torch.Tensor, TileScaled, BlockScaled, PackedMXFP4)
    bad = [type(w).__name__ for w in (w1, w2) if not isinstance(w, known)]
    return f"expert weights of type {bad} are not tensors, TileScaled, BlockScaled or PackedMXFP4" if bad else None


def _log_once(message: str, why: str) -> None:
    if why not in _LOGGED:
        _LOGGED.add(why)
        log.info("moe_experts_grouped on cuda: %s (%s)", message, why)


@register("moe_experts_grouped", "cuda", verifier=_verify,
          note="Triton grouped-expert kernels; else torch grouped_mm for bf16; else every expert over all rows, masked")
def grouped_mlp(xs: torch.Tensor, offsets: torch.Tensor, w1, w2, activation: str = "silu",
                b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                limit: float | None = None, order: torch.Tensor | None = None, top_k: int = 1) -> torch.Tensor:
    # with ``order``, xs is the tokens and sorted row r is token order[r] // top_k (reference.grouped_mlp)
    why = triton_moe.refusal(xs, offsets, w1, w2, activation, b1, b2, limit, order)
    if why is None:
        return triton_moe.moe_experts_grouped(xs, offsets, w1, w2, activation, b1, b2, limit, order=order,
                                              top_k=top_k)
    _log_once("no Triton kernels", why)
    if order is not None:
        xs = xs[order // top_k]
    why = grouped_mm_refusal(xs, w1, w2)
    if why is not None:
        _log_once("every expert over all rows", why)
    fn = grouped_mm_mlp if why is None else masked_grouped_mlp
    return fn(xs, offsets, w1, w2, activation, b1, b2, limit)


def _verify_experts(x, ids, weights, w1, w2, *args, **kwargs) -> str | None:
    return _verify(x, None, w1, w2)


@register("moe_experts", "cuda", verifier=_verify_experts,
          note="few pairs: two Triton GEMV launches reading each pair's expert (no sort); else permute, grouped MLP "
               "(moe_experts_grouped), unpermute")
def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w2, activation: str = "silu",
                    b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    limit: float | None = None, load: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, D]; ids, weights: [T, k]; w1: [E, r*I, D]; w2: [E, D, I]; load: int64 [E] counters, raised
    if direct_kernels.refusal(x, ids, weights, w1, w2, activation, b1, b2, limit) is None:
        return direct_kernels.moe_experts_direct(x, ids, weights, w1, w2, activation, b1, b2, limit, load)
    return sorted_experts(x, ids, weights, w1, w2, activation, b1, b2, limit, load)


def _verify_routed(x, h, router_weight, router_bias, w1, w2, *args, **kwargs) -> str | None:
    return _verify(h, None, w1, w2)


@register("moe_experts_routed", "cuda", verifier=_verify_routed,
          note="few pairs: the router GEMV, then the two direct kernels with the routing inside the first; else "
               "moe_router, moe_experts")
def routed_experts(x: torch.Tensor, h: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                   w1, w2, activation: str = "silu", b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   limit: float | None = None, load: torch.Tensor | None = None, *, top_k: int, kind: str = "sigmoid",
                   correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                   logits: torch.Tensor | None = None) -> torch.Tensor:
    # x: [T, D] the router's input; h: [T, L] the experts'; router_weight: [E, D] fp32; logits: [T, E] fp32, when
    # the caller computed them before h (its projection ran in between: the first kernel may route early)
    routing = (top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    if router_weight.shape[0] == w1.shape[0] and direct_kernels.routed_refusal(
            h, routing, w1, w2, activation, b1, b2, limit) is None:
        ahead = logits is not None and logits.is_contiguous()
        if not ahead:
            logits = call("linear", x, router_weight, router_bias, out_dtype=torch.float32)  # [T, E]
        return direct_kernels.moe_experts_routed(h, logits, routing, w1, w2, activation, b1, b2, limit, load,
                                                 early=ahead)[0]
    if logits is not None:
        weights, ids = call("moe_route", logits, *routing)
    else:
        weights, ids = call("moe_router", x, router_weight, router_bias, *routing)
    return call("moe_experts", h, ids, weights, w1, w2, activation, b1, b2, limit=limit, load=load)


def sorted_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w1, w2, activation: str = "silu",
                   b1: torch.Tensor | None = None, b2: torch.Tensor | None = None, limit: float | None = None,
                   load: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts for any number of pairs, without a host read: the sort (one Triton launch where it runs),
    the grouped MLP reading each sorted row from its token, the weighted gather (Triton where it runs)."""
    E = w1.shape[0]
    sort = permute_kernels.permute if permute_kernels.refusal(ids, E, load) is None else permute
    order, offsets = sort(ids, E, load)
    ys = grouped_mlp(x, offsets, w1, w2, activation, b1, b2, limit, order, ids.shape[1])  # [T*k, D]
    gather = unpermute_kernels.unpermute if unpermute_kernels.refusal(ys, order, weights, x.shape[0]) is None else unpermute
    return gather(ys, order, weights, x.shape[0])
