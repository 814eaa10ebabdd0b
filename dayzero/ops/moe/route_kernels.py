"""Group-limited sigmoid (or sqrt-softplus) routing as one Triton kernel per step: one program per token
scores its experts, ranks the groups by the sum of their two best biased scores, keeps ``topk_group`` of
them and picks the ``top_k`` best experts inside (the reference issues about twenty kernels: sigmoid, two
top-k's, scatter, mask, gather, the normalisation). Up to :data:`RANK_MAX` experts every expert's rank is counted
against all the others at once, in its group and among the kept groups, and an expert of rank < top_k is
written at its rank: a handful of reductions, where picking by repeated arg-max (kept for wider routers)
chains about fifty. Same math as ``reference.route``:
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
RANK_MAX = 256  # up to this many experts (rounded up to a power of two) a token's are ranked by pairwise counts
RANK_TILE = 4096  # comparisons a step of those counts (FB experts against all: a [RANK_TILE / E, E] tile)

if HAS_TRITON:
    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, id_ptr, E, scale, GS: tl.constexpr,
                      SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                      G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                      FB: tl.constexpr, PDL: tl.constexpr):
        grid_dependency(PDL)
        route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, tl.program_id(0).to(tl.int64), E, scale, GS,
                    SQRT_SOFTPLUS, HAS_BIAS, NORM, G, TOPG, K, BE, BG, FB)

    @triton.jit
    def route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS: tl.constexpr,
                    SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                    G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                    FB: tl.constexpr):
        """Token t's routing: its E logits read from row t, its K weights and ids written to rows t, best first;
        FB > 0: by rank (:func:`_route_by_rank`, FB experts counted against all at a time), else by arg-max."""
        if FB > 0:
            _route_by_rank(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS, SQRT_SOFTPLUS, HAS_BIAS, NORM, G,
                           TOPG, K, BE, BG, FB)
        else:
            _route_by_argmax(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS, SQRT_SOFTPLUS, HAS_BIAS, NORM, G,
                             TOPG, K, BE, BG)

    @triton.jit
    def _scores(logits_ptr, bias_ptr, t, e, E, SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Experts e's scores s (fp32) and selection scores (s + bias; -inf past E)."""
        valid = e < E
        x = tl.load(logits_ptr + t * E + e, mask=valid, other=0.0).to(tl.float32)
        if SQRT_SOFTPLUS:
            s = tl.sqrt(softplus(x))
        else:
            s = tl.sigmoid(x)
        sel = s
        if HAS_BIAS:
            sel = sel + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        return s, tl.where(valid, sel, float("-inf"))

    @triton.jit
    def _beats(a, ia, b, ib):
        """[len(a), len(b)]: whether a[f] ranks before b[e], higher or equal with the lower index (ranks unique)."""
        return (a[:, None] > b[None, :]) | ((a[:, None] == b[None, :]) & (ia[:, None] < ib[None, :]))

    @triton.jit
    def _route_by_rank(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS: tl.constexpr,
                       SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, G: tl.constexpr,
                       TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr, FB: tl.constexpr):
        """Every expert's rank counted against every other (FB of them at a time): a few reductions in all,
        where picking by arg-max chains one per pick. An expert of rank < K among the kept groups' is written at
        its rank."""
        e = tl.arange(0, BE)
        s, sel = _scores(logits_ptr, bias_ptr, t, e, E, SQRT_SOFTPLUS, HAS_BIAS)
        grp = e // GS
        gi = tl.arange(0, BG)
        if G > 1:
            inner = tl.zeros((BE,), dtype=tl.int32)  # each expert's rank within its group
            for f0 in tl.static_range(0, BE, FB):
                f = f0 + tl.arange(0, FB)
                sel_f = _scores(logits_ptr, bias_ptr, t, f, E, SQRT_SOFTPLUS, HAS_BIAS)[1]
                same = (f // GS)[:, None] == grp[None, :]
                inner += tl.sum(tl.where(_beats(sel_f, f, sel, e) & same, 1, 0), 0)
            best2 = tl.where(inner < 2, sel, 0.0)  # a group's score: its two best (its one, for groups of one)
            gscore = tl.sum(tl.where(gi[:, None] == grp[None, :], best2[None, :], 0.0), 1)
            gscore = tl.where(gi < G, gscore, float("-inf"))
            keep = (tl.sum(tl.where(_beats(gscore, gi, gscore, gi), 1, 0), 0) < TOPG) & (gi < G)
            kept = tl.sum(tl.where((gi[:, None] == grp[None, :]) & keep[:, None], 1, 0), 0) > 0
        else:
            kept = e < E
        rank = tl.zeros((BE,), dtype=tl.int32)  # among the kept groups' experts
        for f0 in tl.static_range(0, BE, FB):
            f = f0 + tl.arange(0, FB)
            sel_f = _scores(logits_ptr, bias_ptr, t, f, E, SQRT_SOFTPLUS, HAS_BIAS)[1]
            if G > 1:
                kept_f = tl.sum(tl.where(((f // GS)[:, None] == gi[None, :]) & keep[None, :], 1, 0), 1) > 0
            else:
                kept_f = f < E
            rank += tl.sum(tl.where(_beats(sel_f, f, sel, e) & kept_f[:, None], 1, 0), 0)
        chosen = kept & (rank < K)
        ws = tl.where(chosen, s, 0.0)
        if NORM:
            ws = ws / (tl.sum(ws, axis=0) + 1e-20)
        tl.store(id_ptr + t * K + rank, e.to(tl.int64), mask=chosen)
        tl.store(w_ptr + t * K + rank, ws * scale, mask=chosen)

    @triton.jit
    def _route_by_argmax(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS: tl.constexpr,
                         SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                         G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr):
        """Groups ranked by repeated arg-max, then the K best experts picked one at a time: ~50 chained
        reductions, but no [E, E] comparisons (wide routers)."""
        e = tl.arange(0, BE)
        s, sel = _scores(logits_ptr, bias_ptr, t, e, E, SQRT_SOFTPLUS, HAS_BIAS)
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
        constants = route_constants(E, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob)
        # one warp for 64 experts ranked, and up to 256 picked by arg-max (a token's ~50 reductions stay within
        # warp shuffles); four share the wider rank counts
        warps = 1 if constants["BE"] <= 64 or (constants["FB"] == 0 and E <= 256) else 4
        _route_kernel[(T,)](logits, bias, weights, ids, E, float(routed_scaling_factor), **constants,
                            num_warps=warps, **pdl(logits))
    return weights, ids


def route_constants(E: int, top_k: int, kind: str, correction_bias, n_group: int, topk_group: int,
                    norm_topk_prob: bool) -> dict:
    """:func:`route_token`'s compile-time arguments."""
    BE = next_pow2(E)
    return dict(GS=E // n_group, SQRT_SOFTPLUS=kind == "sqrtsoftplus", HAS_BIAS=correction_bias is not None,
                NORM=norm_topk_prob, G=n_group, TOPG=topk_group, K=top_k, BE=BE, BG=next_pow2(n_group),
                FB=max(1, min(BE, RANK_TILE // BE)) if BE <= RANK_MAX else 0)
