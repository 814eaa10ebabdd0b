"""Group-limited sigmoid (or sqrt-softplus) routing as one Triton kernel per step: one program per token
scores its experts, ranks the groups by the sum of their two best biased scores, keeps ``topk_group`` of
them and picks the ``top_k`` best experts inside (the reference issues about twenty kernels: sigmoid, two
top-k's, scatter, mask, gather, the normalisation). Same math as ``reference.route``: fp32, the bias only
steers the selection, weights renormalised over the chosen experts and scaled. Experts come out best first;
exact ties between scores go to the lower expert id and may pick a different expert than ``torch.topk``.

Selection is by rank, not by repeated arg-max: every group's two best scores come from three reductions over a
[groups, experts] tile, each group's place from one comparison of all pairs of groups, and up to
:data:`RANK_MAX` experts each expert's place from one [E, E] comparison, a handful of reductions where ~50
dependent arg-max reductions ran before (more experts keep ``top_k`` arg-max passes). The ranks
(:func:`expert_ranks`) are what the routed experts' first kernel reads when it routes in place
(``dayzero.ops.moe.direct_kernels``).

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
RANK_MAX = 128  # experts up to which a token's ranks come from one [E, E] comparison (else K arg-max passes)

if HAS_TRITON:
    _RANK_MAX = tl.constexpr(RANK_MAX)
    _LOWEST = tl.constexpr(-3.4028234663852886e38)  # the lowest fp32 number: where a NaN score ranks

    @triton.jit
    def _route_kernel(logits_ptr, bias_ptr, w_ptr, id_ptr, E, scale, GS: tl.constexpr,
                      SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                      G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr,
                      PDL: tl.constexpr):
        grid_dependency(PDL)
        route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, tl.program_id(0).to(tl.int64), E, scale, GS,
                    SQRT_SOFTPLUS, HAS_BIAS, NORM, G, TOPG, K, BE, BG)

    @triton.jit
    def expert_ranks(logits_ptr, bias_ptr, t, E, GS: tl.constexpr, SQRT_SOFTPLUS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr,
                     BE: tl.constexpr, BG: tl.constexpr):
        """Token t's routing as ranks: (e = arange(BE), its scores s [BE] fp32 (unbiased), rank [BE] int32).
        The experts chosen are those of rank < K, best first; the others' ranks are K or more. Ties go to the
        lower expert id, as arg-max breaks them. A NaN score (NaN logits) ranks after every number, so each rank
        below K still goes to exactly one expert, K distinct ids."""
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
        sel = tl.where(valid, tl.where(sel == sel, sel, _LOWEST), float("-inf"))  # NaN: below every number
        if G > 1:  # every group's two best scores at once, then the groups ranked by their sums
            gi = tl.arange(0, BG)
            member = (e[None, :] // GS) == gi[:, None]  # [BG, BE]
            mine = tl.where(member, sel[None, :], float("-inf"))
            total = tl.max(mine, axis=1)
            if GS > 1:
                at = tl.argmax(mine, axis=1)
                total += tl.max(tl.where(e[None, :] == at[:, None], float("-inf"), mine), axis=1)
            total = tl.where(gi < G, total, float("-inf"))
            ahead = (total[None, :] > total[:, None]) | ((total[None, :] == total[:, None]) & (gi[None, :] < gi[:, None]))
            keep = (tl.sum(ahead.to(tl.int32), axis=1) < TOPG) & (gi < G)
            kept = tl.max(tl.where(member & keep[:, None], 1, 0), axis=0) > 0
            sel = tl.where(kept, sel, float("-inf"))
        if BE <= _RANK_MAX:  # each expert's place: the experts ahead of it, all pairs compared at once
            ahead = (sel[None, :] > sel[:, None]) | ((sel[None, :] == sel[:, None]) & (e[None, :] < e[:, None]))
            rank = tl.sum(ahead.to(tl.int32), axis=1)
        else:  # K arg-max passes: a [BE, BE] comparison would not fit a program's registers
            rank = tl.full((BE,), K, tl.int32)
            for j in tl.static_range(K):
                at = tl.argmax(sel, axis=0)
                rank = tl.where(e == at, j, rank)
                sel = tl.where(e == at, float("-inf"), sel)
        return e, s, rank

    @triton.jit
    def route_token(logits_ptr, bias_ptr, w_ptr, id_ptr, t, E, scale, GS: tl.constexpr,
                    SQRT_SOFTPLUS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr,
                    G: tl.constexpr, TOPG: tl.constexpr, K: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr):
        """Token t's routing: its E logits read from row t, its K weights and ids written to rows t."""
        e, s, rank = expert_ranks(logits_ptr, bias_ptr, t, E, GS, SQRT_SOFTPLUS, HAS_BIAS, G, TOPG, K, BE, BG)
        kk = tl.arange(0, K)
        pick = rank[None, :] == kk[:, None]  # [K, BE]: slot j holds the expert of rank j
        ids = tl.sum(tl.where(pick, e[None, :], 0), axis=1)
        ws = tl.sum(tl.where(pick, s[None, :], 0.0), axis=1)
        if NORM:
            ws = ws / (tl.sum(tl.where(rank < K, s, 0.0), axis=0) + 1e-20)
        tl.store(id_ptr + t * K + kk, ids.to(tl.int64))
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
