"""``act_linear`` on a GPU: an MLP's activation run inside its down projection's skinny kernel
(``kernels._skinny_kernel`` with ``ACT``), one launch where a decode step ran two.

The kernel reads the [gate | up] rows of the first projection where it would read its input, applies the
activation to each K step (rounded to the rows' dtype, as the activation op writes it) and multiplies. The
hidden rows [M, I] are never written. A LatentMoE layer's shared expert (activation, down projection) and a
dense MLP's decode rows take it.

Whether it runs is measured, like the linear's own choice: at a key's first eager call, the fused launch at each
block shape against the activation kernel followed by the linear's measured choice, each replayed from a CUDA
graph over L2-cold weight copies; the fused launch runs where it is faster.
"""
from __future__ import annotations

import torch

from dayzero.ops.linear import kernels as K
from dayzero.ops.registry import register

_CHOICE: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the activation apart


def _hidden(x: torch.Tensor, activation: str) -> torch.Tensor:
    """A view of x shaped like the activation's output [M, I] (the linear's key and refusals read shapes only)."""
    return x[:, :x.shape[1] // K.ACTS[activation][1]]


def _limit(activation: str, limit: float | None) -> float | None:
    return 7.0 if activation == "swiglu_oai" and limit is None else limit  # gpt-oss's clamp, as its op defaults


def _key(x, weight, bias, activation, limit, add) -> tuple:
    return K._key(_hidden(x, activation), weight, bias, None, add) + (activation, limit)


def _verify_act(x, weight, bias=None, activation="silu", limit=None, add=None) -> str | None:
    if activation not in K.ACTS:
        return f"unknown activation {activation!r}"
    if x.dim() != 2 or x.shape[-1] != K.ACTS[activation][1] * weight.shape[-1]:
        return f"{activation} needs rows of {K.ACTS[activation][1]} x the weight's in-features"
    why = K._verify(_hidden(x, activation), weight, bias, None, add)
    if why is None and measured_choice(x, weight, bias, activation, limit, add) is None:
        return "the activation kernel and the linear apart are as fast or faster at this shape (measured)"
    return why


def timings(x, weight, bias=None, activation="silu", limit=None, add=None) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of the activation kernel then the linear's own choice (None) against the fused
    launch, on random rows of x's shape (and an add)."""
    from dayzero.ops.activation.kernels import KINDS, act

    xs = torch.randn(x.shape, device=x.device).to(x.dtype)
    adds = None if add is None else torch.randn(x.shape[0], weight.shape[0], device=x.device).to(add.dtype)
    apart_block = K.measured_choice(_hidden(xs, activation), weight, bias, None, adds)
    kind, clamp = KINDS[activation], _limit(activation, limit)
    return K.fused_timings(
        weight, lambda w: K.chosen_linear(act(xs, kind, clamp), w, bias, None, adds, apart_block),
        lambda w, b: K.skinny_linear(xs, w, bias, None, b, adds, activation, clamp),
        K.candidates(xs.shape[0], weight.shape[0], weight.shape[1]))


def measured_choice(x, weight, bias=None, activation="silu", limit=None, add=None) -> K.Block | None:
    """The block shape of the fused launch when it ran faster than the activation apart (measured at the key's
    first call, on the key's bucket of rows), else None."""
    key = _key(x, weight, bias, activation, limit, add)
    xs = K.bucket_rows(x, key[0])  # the bucket's shape (timings draws its own rows)
    return K.measure_once(_CHOICE, key, x.device, lambda: K.fused_choice(
        f"act_linear {activation} {key[0]} x [{weight.shape[0]}, {weight.shape[1]}]",
        timings(xs, weight, bias, activation, limit, add)))


@register("act_linear", "cuda", verifier=_verify_act,
          note="the activation inside the skinny linear kernel (1-8 rows, where measured faster than the two apart)")
def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu",
               limit: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    return K.skinny_linear(x, weight, bias, None, _CHOICE[_key(x, weight, bias, activation, limit, add)], add,
                           activation, _limit(activation, limit))
