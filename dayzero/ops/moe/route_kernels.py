"""Group-limited sigmoid (or sqrt-softplus) routing as one Triton kernel per step: one program per token
scores its experts, ranks the groups by the sum of their two best biased scores, keeps ``topk_group`` of
them and picks the ``top_k`` best experts inside, by repeated arg-max (the reference issues about twenty
kernels: sigmoid, two top-k's, scatter, mask, gather, the normalisation). Same math as ``reference.route``:
fp32, the bias only steers the selection, weights renormalised over the chosen experts and scaled. Experts
come out best first; exact ties between scores may pick a different expert than ``torch.topk``.

Softmax routing, hash routing (``fixed_ids``) and more than 32 experts per token or groups are left to the
reference.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, next_pow2, pdl, tl, triton, triton_refusal

if HAS_TRITON:
    from dayzero.ops.triton_support import grid_dependency, softplus

MAX_K = 32
MAX_GROUPS = 32

if HAS_TRITON:
    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, id_ptr, E, scale, GS: tl.constexpr,
                      SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                      G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                      PDL: tl.constexpr):
        grid_dependency(PDL)
        route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, tl.program_id(0).to(tl.int64), E, scale, GS,
                    SQRT_SOFTPLUS, HAS_BIAS, NORM, G, TOPG, K, BE, BG)

    @triton.jit
    def route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS: tl.constexpr,
                    SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                    G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr):
        """Token t's routing: its E logits read from row t, its K weights and ids written to rows t."""
        e = tl.arange(0, BE)
        valid = e < E
        x = tl.load(logits_ptr + t * E + e, mask=valid, other=0.0).to(tl.float32)
        if SQRT_SOFTPLUS:
            s = tl.sqrt(softplus(x))
        else:
            s = tl.sigmoid(x)
        sel = s
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        sel = tl.where(valid, sel, float("-inf"))
        if G > 1:
            grp = e // GS
            gi = tl.arange(0, BG)
            gscore = tl.full((BG,), float("-inf"), tl.float32)
            for g in tl.static_range(G):
                mine = tl.where(grp == g, sel, float("-inf"))
                best = tl.max(mine, axis=0)
                at = tl.argmax(mine, axis=0)
                total = best
                if GS > 1:
                    total = best + tl.max(tl.where(e == at, float("-inf"), mine), axis=0)
                gscore = tl.where(gi == g, total, gscore)
            keep = tl.zeros((BG,), dtype=tl.int1)
            for _ in tl.static_range(TOPG):
                at = tl.argmax(gscore, axis=0)
                keep = keep | (gi == at)
                gscore = tl.where(gi == at, float("-inf"), gscore)
            kept = tl.sum(tl.where((gi[None, :] == grp[:, None]) & keep[None, :], 1, 0), axis=1) > 0
            sel = tl.where(kept, sel, float("-inf"))
        kk = tl.arange(0, K)
        ids = tl.zeros((K,), dtype=tl.int64)
        ws = tl.zeros((K,), dtype=tl.float32)
        for j in tl.static_range(K):
            at = tl.argmax(sel, axis=0)
            ids = tl.where(kk == j, at.to(tl.int64), ids)
            ws = tl.where(kk == j, tl.sum(tl.where(e == at, s, 0.0), axis=0), ws)
            sel = tl.where(e == at, float("-inf"), sel)
        if NORM:
            ws = ws / (tl.sum(ws, axis=0) + 1e-20)
        tl.store(id_ptr + t * K + kk, ids)
        tl.store(w_ptr + t * K + kk, ws * scale)


def route_refusal(logits, top_k, kind="sigmoid", correction_bias=None, n_group=1, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=1.0, fixed_ids=None) -> str | None:
    why = triton_refusal(logits)
    if why is not None:
        return why
    if kind not in ("sigmoid", "sqrtsoftplus") or fixed_ids is not None:
        return f"{kind} routing{' with fixed ids' if fixed_ids is not None else ''} runs the reference"
    if logits.dim() != 2 or not logits.is_contiguous():
        return "logits must be a contiguous [T, E]"
    E = logits.shape[1]
    if not 1 <= top_k <= min(E, MAX_K) or n_group > MAX_GROUPS or n_group < 1 or E % n_group:
        return f"top_k={top_k}, n_group={n_group} over {E} experts is outside what the kernel takes"
    if not 1 <= topk_group <= n_group or top_k > topk_group * (E // n_group):
        return "the reference checks these arguments"  # and raises its own error
    if top_k & (top_k - 1):
        return f"top_k={top_k} is not a power of two"
    return None


@register("moe_route", "cuda", verifier=route_refusal, note="Triton, one program per token (sigmoid / sqrt-softplus)")
def route(logits: torch.Tensor, top_k: int, kind: str = "sigmoid", correction_bias: torch.Tensor | None = None,
          n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
          fixed_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # logits: [T, E] -> (weights fp32 [T, k], ids int64 [T, k])
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T:
        bias = correction_bias if correction_bias is not None else logits
        # one warp up to 256 experts: a token's ~50 arg-max / max reductions stay within warp shuffles
        _route_kernel[(T,)](logits, bias, weights, ids, E, float(routed_scaling_factor),
                            **route_constants(E, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob),
                            num_warps=1 if E <= 256 else 4, **pdl(logits))
    return weights, ids


def route_constants(E: int, top_k: int, kind: str, correction_bias, n_group: int, topk_group: int,
                    norm_topk_prob: bool) -> dict:
    """:func:`route_token`'s compile-time arguments."""
    return dict(GS=E // n_group, SQRT_SOFTPLUS=kind == "sqrtsoftplus", HAS_BIAS=correction_bias is not None,
                NORM=norm_topk_prob, G=n_group, TOPG=topk_group, K=top_k, BE=next_pow2(E), BG=next_pow2(n_group))
