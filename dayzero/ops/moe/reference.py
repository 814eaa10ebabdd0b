"""Reference MoE ops: router top-k, the routed experts as permute -> grouped MLP -> unpermute, and the
dense MLP they share math with.

ARCHITECTURE section 3. Everything is computed in fp32; expert and MLP outputs come back in the
input's dtype, routing weights stay fp32. The routed experts are split into separate ops so that expert
parallelism can put its all-to-all between the permute and the expert GEMMs:

    route -> permute (pairs sorted by expert) -> gather rows -> grouped MLP -> unpermute (weighted sum)

``moe_route``, ``moe_permute`` and ``moe_unpermute`` never read device data on the host (they run on
CUDA as they are, inside CUDA graphs); the grouped MLP reference loops over experts on the host.
"""
from __future__ import annotations

import functools

import torch

from dayzero.ops.activation.reference import relu2, silu_and_mul, swiglu_oai
from dayzero.ops.registry import call, register
from dayzero.quant.fp8 import quantize_activations, takes_fp8_activations

# activation name -> (function on the w1 output, rows of w1 per intermediate channel)
_ACTIVATIONS = {
    "silu": (silu_and_mul, 2),  # w1 = [gate; up], gated
    "relu2": (relu2, 1),        # w1 = up only (Nemotron-H / LatentMoE experts)
    "swiglu_oai": (swiglu_oai, 2),  # gpt-oss: w1 = [gate; up], clamped SwiGLU
}


def _activation(name: str, w1: torch.Tensor, w2: torch.Tensor, limit: float | None = None):
    """Look up ``name`` and check that w1 [.., r*I, D] and w2 [.., D, I] fit it and each other; ``limit``
    clamps the gated SiLU's inputs (``silu`` only)."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(_ACTIVATIONS)}")
    if limit is not None and name != "silu":
        raise ValueError(f"a clamp limit applies to the 'silu' activation only, not {name!r}")
    fn, rows = _ACTIVATIONS[name]
    if limit is not None:
        fn = functools.partial(silu_and_mul, limit=limit)
    inter, d_in, d_out = w2.shape[-1], w1.shape[-1], w2.shape[-2]
    if w1.shape[-2] != rows * inter or d_in != d_out:
        raise ValueError(f"activation {name!r} needs w1 [.., {rows}*I, D] and w2 [.., D, I]; "
                         f"got w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}")
    return fn


def _mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act, b1=None, b2=None,
         fp8_x: bool = False, fp8_h: bool = False) -> torch.Tensor:
    """One expert or dense MLP in fp32: ``w2 · act(w1 · x + b1) + b2``; ``fp8_x`` / ``fp8_h`` take the input of
    the first / second product through FP8 first (:func:`quantize_activations`)."""
    # x: [N, D] fp32; w1: [r*I, D]; w2: [D, I] -> [N, D] fp32
    h = (quantize_activations(x) if fp8_x else x) @ w1.float().t()
    if b1 is not None:
        h = h + b1.float()
    h = act(h)
    y = (quantize_activations(h) if fp8_h else h) @ w2.float().t()
    return y if b2 is None else y + b2.float()


@register("moe_router")
def moe_router(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, kind: str = "sigmoid",
               correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's fp32 logits ``x · weightᵀ + bias`` (the ``linear`` op) routed by ``moe_route``: (weights fp32
    [T, k], ids int64 [T, k]). Each its own op here (and so its own kernels on a device)."""
    # x: [T, D]; weight: [E, D]; bias: [E] or None
    logits = call("linear", x, weight, bias, out_dtype=torch.float32)
    return call("moe_route", logits, top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob,
                routed_scaling_factor)


@register("moe_route")
def route(logits: torch.Tensor, top_k: int, kind: str = "sigmoid",
          correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0, fixed_ids: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; returns ``(weights fp32 [T, k], ids int64 [T, k])``.

    ``kind="sigmoid"`` (DeepSeek-V3, Kimi-Linear, Nemotron-H): ``s = sigmoid(logits)``; selection
    uses ``s + correction_bias``, limited to the ``topk_group`` groups whose top-2 biased scores sum
    highest; weights use the unbiased ``s``. ``kind="sqrtsoftplus"`` (DeepSeek-V4) is the same with
    ``s = sqrt(softplus(logits))``. ``fixed_ids`` [T, k] (hash routing) replaces the selection: the
    weights are the scores of those experts (repeats count twice). ``kind="softmax"`` (Qwen3-MoE):
    top-k of the softmax over all experts; no bias and no groups. All renormalise over the chosen
    experts when ``norm_topk_prob`` and then multiply by ``routed_scaling_factor``.
    """
    # logits: [T, E] router output
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, E={E}]")
    if n_group < 1 or E % n_group:
        raise ValueError(f"E={E} experts cannot be split into n_group={n_group} equal groups")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in [1, n_group={n_group}]")
    group_size = E // n_group
    if top_k > topk_group * group_size:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * group_size} experts "
                         f"in the {topk_group} kept groups")
    # The router's selection is sensitive to rounding, hence fp32 as in the DeepSeek reference.
    logits = logits.float()

    if fixed_ids is not None and kind not in ("sigmoid", "sqrtsoftplus"):
        raise ValueError(f"fixed expert ids (hash routing) need 'sigmoid' or 'sqrtsoftplus' scores, not {kind!r}")
    if kind in ("sigmoid", "sqrtsoftplus"):
        scores = torch.sigmoid(logits) if kind == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()  # [T, E]
        if fixed_ids is not None:
            # The id range is checked on the host only when that is free: on an accelerator it would wait for
            # the device, and the MoE layer checks its table once after loading instead.
            host = fixed_ids.device.type == "cpu"
            bad = host and fixed_ids.numel() and not 0 <= int(fixed_ids.min()) <= int(fixed_ids.max()) < E
            if fixed_ids.shape != (T, top_k) or bad:
                raise ValueError(f"fixed_ids must be [T={T}, k={top_k}] expert ids in [0, {E}), got {tuple(fixed_ids.shape)}")
            ids = fixed_ids.long()
        else:
            select = scores if correction_bias is None else scores + correction_bias.float()
            if n_group > 1:
                grouped = select.view(T, n_group, group_size)  # [T, G, E/G]
                group_score = grouped.topk(min(2, group_size), dim=-1).values.sum(-1)  # [T, G]
                kept = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
                keep = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device)
                keep.scatter_(1, kept, True)
                select = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
            ids = select.topk(top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)  # unbiased: the bias only steers selection
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    elif kind == "softmax_topk":
        # gpt-oss: top-k of the raw logits, softmax over the chosen k only
        if correction_bias is not None or n_group != 1:
            raise ValueError("softmax_topk routing takes no correction_bias and no expert groups")
        top, ids = logits.topk(top_k, dim=-1)  # [T, k]
        weights = top.softmax(dim=-1)
    elif kind == "softmax":
        if correction_bias is not None or n_group != 1:
            raise ValueError("softmax routing takes no correction_bias and no expert groups")
        probs = logits.softmax(dim=-1)  # [T, E]
        weights, ids = probs.topk(top_k, dim=-1)  # [T, k]
        if norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
    else:
        raise ValueError(f"unknown routing kind {kind!r}; expected 'sigmoid', 'sqrtsoftplus', 'softmax' or 'softmax_topk'")
    return weights * routed_scaling_factor, ids


@register("moe_permute")
def permute(ids: torch.Tensor, num_experts: int, load: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert; returns ``(order int64 [T*k], offsets int32 [E])``.

    ``order[r]`` is the flat pair index (``t * k + j``) of sorted row r, so ``order // k`` is its token;
    the sort is stable, so within one expert the rows keep token order. ``offsets[e]`` is the end
    (exclusive) of expert e's rows: the cumulative counts ``grouped_mm(offs=...)`` takes. Nothing is read
    back to the host (``bincount`` would read its output size), so this runs inside a CUDA graph.

    ``load`` (int64 [E]), when given, is raised by the offsets in place: the running sums whose differences are
    the pairs routed to each expert (the MoE layer's load counters).
    """
    # ids: [T, k] expert ids in [0, E)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [T, k], got {tuple(ids.shape)}")
    flat = ids.reshape(-1).long()  # [T*k]
    order = torch.argsort(flat, stable=True)  # [T*k]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    offsets = counts.cumsum(0)
    if load is not None:
        if load.dtype != torch.int64 or load.shape != (num_experts,):
            raise ValueError(f"load must be int64 [{num_experts}], got {load.dtype} {tuple(load.shape)}")
        load += offsets
    return order, offsets.to(torch.int32)


@register("moe_experts_grouped")
def grouped_mlp(xs: torch.Tensor, offsets: torch.Tensor, w1, w2, activation: str = "silu",
                b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                limit: float | None = None, order: torch.Tensor | None = None, top_k: int = 1) -> torch.Tensor:
    """Rows sorted by expert, each through its expert: ``ys[r] = w2_e · act(w1_e · xs[r] + b1_e) + b2_e``.

    With ``order`` (``moe_permute``'s pair order) ``xs`` holds the tokens [T, L] instead, and sorted row r is
    token ``order[r] // top_k`` (a device implementation reads it in place rather than gathering the rows).

    Expert e owns rows ``offsets[e-1]:offsets[e]`` (``moe_permute``'s layout); rows past ``offsets[-1]``
    are padding and come out zero here. ``w1`` / ``w2`` are stacked tensors or expert-indexable
    containers (``TileScaled``, ``BlockScaled``, ``PackedMXFP4``: ``w[e]`` is expert e's fp32 weight). Each
    expert runs as ONE GEMM pair over its rows, in fp32; the output is in ``xs.dtype``. This reference reads
    the offsets on the host.
    """
    # xs: [N, L]; offsets: [E] int32; w1: [E, r*I, L] (r=2 gated: rows [gate; up]); w2: [E, L, I] -> [N, L]
    if order is not None:
        xs = xs[order // top_k]
    act = _activation(activation, w1, w2, limit)
    E, N = w1.shape[0], xs.shape[0]
    if offsets.shape != (E,) or xs.dim() != 2 or xs.shape[1] != w1.shape[-1]:
        raise ValueError(f"xs {tuple(xs.shape)} and offsets {tuple(offsets.shape)} must be [N, {w1.shape[-1]}] and [{E}]")
    ends = offsets.tolist()
    if any(b < a for a, b in zip([0] + ends, ends)) or (ends and ends[-1] > N):
        raise ValueError(f"offsets must be non-decreasing row ends within the {N} rows, got {ends}")
    ys = torch.zeros(N, w2.shape[-2], dtype=torch.float32, device=xs.device)  # [N, L]
    for e, (start, end) in enumerate(zip([0] + ends, ends)):
        if end > start:
            ys[start:end] = _mlp(xs[start:end].float(), w1[e], w2[e], act,
                                 None if b1 is None else b1[e], None if b2 is None else b2[e],
                                 takes_fp8_activations(w1), takes_fp8_activations(w2))
    return ys.to(xs.dtype)


@register("moe_unpermute")
def unpermute(ys: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: ``out[t] = sum_j weights[t, j] * ys[row of (t, j)]``.

    The k outputs of a token are summed in fp32 (``index_add_``, no host reads); the result is in
    ``ys.dtype``.
    """
    # ys: [N, L] rows in expert order; order: [N] flat pair index of each row; weights: [T, k] fp32
    if weights.dim() != 2 or weights.shape[0] != num_tokens or order.shape != (ys.shape[0],):
        raise ValueError(f"weights {tuple(weights.shape)} must be [T={num_tokens}, k] and order "
                         f"{tuple(order.shape)} must have one entry per row of ys {tuple(ys.shape)}")
    k = weights.shape[1]
    ws = weights.reshape(-1).float()[order]  # [N] weight of each sorted row
    out = torch.zeros(num_tokens, ys.shape[1], dtype=torch.float32, device=ys.device)
    out.index_add_(0, order // k, ys.float() * ws[:, None])
    return out.to(ys.dtype)


@register("moe_experts")
def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    w1: torch.Tensor, w2: torch.Tensor, activation: str = "silu",
                    b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                    limit: float | None = None, load: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: ``y_t = sum_j weights[t, j] * Expert_{ids[t, j]}(x_t)``; ``limit``: clamped SwiGLU;
    ``load``: the layer's counters, raised as :func:`permute` raises them.

    The composition ``moe_permute`` -> gather rows -> ``moe_experts_grouped`` -> ``moe_unpermute``: the
    (token, slot) pairs are sorted by expert so that each expert's rows are one contiguous segment and
    the expert runs as ONE GEMM over them, the layout grouped-GEMM kernels and expert parallelism
    (all-to-all dispatch by expert) work on. The expert outputs are rounded to ``x.dtype`` (the dtype rows
    travel in between the ops) before the fp32 weighted sum.
    """
    # x: [T, D]; ids, weights: [T, k]; w1: [E, r*I, D]; w2: [E, D, I]
    _activation(activation, w1, w2, limit)
    T, E = x.shape[0], w1.shape[0]
    if ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T={T}, k]")
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < E):
        raise ValueError(f"expert ids must lie in [0, {E})")
    order, offsets = permute(ids, E, load)
    ys = grouped_mlp(x[order // ids.shape[1]], offsets, w1, w2, activation, b1, b2, limit)  # [T*k, D]
    return unpermute(ys, order, weights, T)


@register("moe_experts_routed")
def routed_experts(x: torch.Tensor, h: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
                   w1: torch.Tensor, w2: torch.Tensor, activation: str = "silu", b1: torch.Tensor | None = None,
                   b2: torch.Tensor | None = None, limit: float | None = None, load: torch.Tensor | None = None, *,
                   top_k: int, kind: str = "sigmoid", correction_bias: torch.Tensor | None = None, n_group: int = 1,
                   topk_group: int = 1, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0,
                   logits: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_router`` of the router input ``x`` then ``moe_experts`` of the experts' input ``h`` (x itself, or
    its LatentMoE down-projection): the routing and the routed experts as one op, so that a device may route
    inside the experts' first kernel. Here each is its own op. ``logits``: the router's fp32 logits of x when the
    caller computed them before h (a MoE layer that runs its router first); then only ``moe_route`` runs here."""
    # x: [T, D]; h: [T, L]; router_weight: [E, D]; w1: [E, r*I, L]; w2: [E, L, I]; logits: [T, E] -> [T, L]
    routing = (top_k, kind, correction_bias, n_group, topk_group, norm_topk_prob, routed_scaling_factor)
    if logits is not None:
        weights, ids = call("moe_route", logits, *routing)
    else:
        weights, ids = call("moe_router", x, router_weight, router_bias, *routing)
    return call("moe_experts", h, ids, weights, w1, w2, activation, b1, b2, limit=limit, load=load)


@register("mlp")
def dense_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, activation: str = "silu",
              limit: float | None = None) -> torch.Tensor:
    """Dense MLP with the same math as one expert: ``w2 · act(w1 · x)``; ``limit``: clamped SwiGLU."""
    # x: [..., D]; w1: [r*I, D]; w2: [D, I]
    act = _activation(activation, w1, w2, limit)
    return _mlp(x.float(), w1, w2, act).to(x.dtype)
