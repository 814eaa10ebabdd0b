"""``moe_router``: a MoE layer's router GEMV and its routing as one Triton launch for a decode step's few rows.

The router is an fp32 GEMV of the layer's input against [E, D] weights (0.5 MB at 64 experts of 2048), and the
routing reads all E logits of a token, so it ran as two launches: the skinny linear, then one routing program
per token. Here each program computes ``BLOCK_N`` experts' logits for every row and stores them; the program that
finishes last (a counter bumped once by each, with acquire-release semantics, so the others' logits are visible to
it) routes every row with the routing kernel's own per-token code and puts the counter back to zero for the next
launch. The counter is one int32 per router weight, made at the layer's first eager call (a layer first met inside
a CUDA-graph capture runs the two ops apart).

Whether it runs is measured per shape at the first eager call against the linear's own choice followed by the
routing kernel, replayed from CUDA graphs over L2-cold weight copies, like the other fused launches
(``dayzero.ops.linear.kernels.fused_timings``).
"""
from __future__ import annotations

import torch

from dayzero.ops.linear import kernels as K
from dayzero.ops.moe.route_kernels import route_constants, route_refusal
from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton

if HAS_TRITON:
    from dayzero.ops.moe.route_kernels import route_token
    from dayzero.ops.triton_support import grid_dependency

    @triton.jit
    def _router_kernel(x_ptr, w_ptr, b_ptr, logits_ptr, count_ptr, bias_ptr, wout_ptr, id_ptr, M, E, D, s_xm, s_wn,
                       scale, HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GS: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr, TOPG: tl.constexpr,
                       K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr, PDL: tl.constexpr):
        # x: [M, D]; w: [E, D]; logits: [M, E] fp32 scratch; count: one int32, zero between launches
        grid_dependency(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = n < E, m < M
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < D
            w = tl.load(w_ptr + n.to(tl.int64)[:, None] * s_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
        if HAS_B:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(logits_ptr + m[:, None] * E + n[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])
        tl.debug_barrier()  # every thread's logits stored before the program's one atomic
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel")  # releases this program's logits, acquires the others'
        if done == tl.num_programs(0) - 1:  # every other program has stored its logits
            tl.atomic_xchg(count_ptr, 0)
            for t in range(0, M):
                route_token(logits_ptr, bias_ptr, wout_ptr, id_ptr, t, E, scale, GS, SQRT_SOFTPLUS, HAS_BIAS, NORM,
                            G, TOPG, K, BE, BG)


def candidates(rows: int, experts: int, dim: int) -> list[K.Block]:
    """Block shapes worth timing: 2, 4 or 8 experts a program (more programs stream the fp32 weight faster)."""
    bm, out = next_pow2(rows), []
    for bn in (2, 4, 8):
        bn = min(bn, next_pow2(experts))
        block = (bn, max(16, min(8192 // (bm * bn), next_pow2(dim), 2048)), 4)
        if block not in out:
            out.append(block)
    return out


_COUNTERS: dict[tuple, torch.Tensor] = {}  # (device, router weight's address) -> its launch counter


def router_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int,
                 kind: str = "sigmoid", correction_bias: torch.Tensor | None = None, n_group: int = 1,
                 topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                 block: K.Block | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's fp32 logits of x and their routing in one launch: (weights fp32 [M, k], ids int64 [M, k])."""
    M, (E, D) = x.shape[0], weight.shape
    weights = torch.empty(M, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(M, top_k, dtype=torch.int64, device=x.device)
    if M == 0:
        return weights, ids
    logits = torch.empty(M, E, dtype=torch.float32, device=x.device)
    bn, bk, warps = block or candidates(M, E, D)[0]
    _router_kernel[(triton.cdiv(E, bn),)](
        x, weight, weight if bias is None else bias, logits, _counter(weight),
        logits if correction_bias is None else correction_bias, weights, ids, M, E, D, x.stride(0), weight.stride(0),
        float(routed_scaling_factor), HAS_B=bias is not None, BLOCK_M=next_pow2(M), BLOCK_N=bn, BLOCK_K=bk,
        **route_constants(E, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob), num_warps=warps,
        **pdl(x))
    return weights, ids


def _counter(weight: torch.Tensor) -> torch.Tensor:
    key = (weight.device, weight.data_ptr())
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=weight.device)
    return _COUNTERS[key]


_CHOICE: dict[tuple, K.Block | None] = {}  # key -> the one launch's block shape, None: the two ops apart


def _key(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob) -> tuple:
    return K._key(x, weight, bias, torch.float32, None) + (
        top_k, kind, correction_bias is not None, n_group, topk_group, norm_topk_prob)


def timings(x, weight, bias, top_k, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.0) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of the linear's own choice then the routing kernel (None) against the one
    launch, on random rows of x's shape."""
    from dayzero.ops.moe.route_kernels import route

    xs = torch.randn(x.shape, device=x.device).to(x.dtype)
    route_args = (top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    apart_block = K.measured_choice(xs, weight, bias, torch.float32)

    def apart(w):
        return route(K.chosen_linear(xs, w, bias, torch.float32, None, apart_block), *route_args)

    before = set(_COUNTERS)
    try:  # each weight copy's counter is made at its eager call, before the graph that replays it
        return K.fused_timings(weight, apart, lambda w, b: router_route(xs, w, bias, *route_args, block=b),
                               candidates(x.shape[0], weight.shape[0], weight.shape[1]))
    finally:
        for key in set(_COUNTERS) - before - {(weight.device, weight.data_ptr())}:
            del _COUNTERS[key]  # the copies' counters


def measured_choice(x, weight, bias, top_k, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1,
                    norm_topk_prob=True, routed_scaling_factor=1.0) -> K.Block | None:
    """The one launch's block shape when it ran faster than the two apart (measured at the key's first eager
    call, on the key's bucket of rows), else None."""
    key = _key(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob)
    xs = K.bucket_rows(x, key[0])

    return K.measure_once(_CHOICE, key, x.device, lambda: K.fused_choice(
        f"moe_router {key[0]} x [{weight.shape[0]}, {weight.shape[1]}]",
        timings(xs, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob,
                routed_scaling_factor)), "moe_router")


def _verify(x, weight, bias, top_k, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1,
            norm_topk_prob=True, routed_scaling_factor=1.0) -> str | None:
    why = K.refusal(x, weight, bias, torch.float32) or route_refusal(
        x.new_empty((0, weight.shape[0]), dtype=torch.float32), top_k, kind, correction_bias, n_group, topk_group,
        norm_topk_prob, routed_scaling_factor)  # the logits' shape
    if why is None and measured_choice(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group,
                                       norm_topk_prob, routed_scaling_factor) is None:
        return "the router GEMV and the routing kernel apart are as fast or faster at this shape (measured)"
    if why is None and (weight.device, weight.data_ptr()) not in _COUNTERS:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return "this router's first call is inside a CUDA-graph capture (its launch counter is made eagerly)"
        _counter(weight)
    return why


@register("moe_router", "cuda", verifier=_verify,
          note="the router GEMV and the routing in one launch (1-8 rows, where measured faster than apart)")
def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, kind: str = "sigmoid",
               correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    block = _CHOICE[_key(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob)]
    return router_route(x, weight, bias, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob,
                        routed_scaling_factor, block)
