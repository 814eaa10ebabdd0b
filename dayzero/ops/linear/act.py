"""``act_linear`` on a GPU: an MLP's activation run inside its down projection's skinny kernel
(``kernels._skinny_kernel`` with ``ACT``), one launch where a decode step ran two; ``dual_linear``: a second
product summed in the same launch (``TWO``), a LatentMoE block's up-projection and its shared expert's activation
and down projection in one launch where a decode step ran three; ``sigmoid_gate_linear``: gated attention's output
gate inside its output projection.

The kernel reads the [gate | up] rows of the first projection where it would read its input, applies the
activation to each K step (rounded to the rows' dtype, as the activation op writes it) and multiplies. The
hidden rows [M, I] are never written. A LatentMoE layer's shared expert (activation, down projection) and a
dense MLP's decode rows take it.

Whether it runs is measured, like the linear's own choice: at a key's first eager call, the fused launch at each
block shape against the activation kernel followed by the linear's measured choice, each replayed from a CUDA
graph over L2-cold weight copies; the fused launch runs where it is faster, also where the linear alone keeps
cuBLAS (the kernel apart still costs a launch). ``dual_linear`` is measured the same
way against ``act_linear`` and ``linear`` apart, each as its own measurement chose.
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
    why = K.refusal(_hidden(x, activation), weight, bias, None, add)
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
        K.candidates(xs.shape[0], weight.shape[0], weight.shape[1], K.tensor_cores(x.dtype, weight.dtype)))


def measured_choice(x, weight, bias=None, activation="silu", limit=None, add=None) -> K.Block | None:
    """The block shape of the fused launch when it ran faster than the activation apart (measured at the key's
    first call, on the key's bucket of rows), else None."""
    key = _key(x, weight, bias, activation, limit, add)
    xs = K.bucket_rows(x, key[0])  # the bucket's shape (timings draws its own rows)
    return K.measure_once(_CHOICE, key, x.device, lambda: K.fused_choice(
        f"act_linear {activation} {key[0]} x [{weight.shape[0]}, {weight.shape[1]}]",
        timings(xs, weight, bias, activation, limit, add)), "act_linear")


@register("act_linear", "cuda", verifier=_verify_act,
          note="the activation inside the skinny linear kernel "
               "(1-8 rows, up to 64 on the tensor cores, where measured faster than the two apart)")
def act_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "silu",
               limit: float | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    return K.skinny_linear(x, weight, bias, None, _CHOICE[_key(x, weight, bias, activation, limit, add)], add,
                           activation, _limit(activation, limit))


# --- dual_linear: two products summed in one launch ------------------------------------------------------------
_DUAL: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the two ops apart


def dual_skinny_linear(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                       activation: str | None = None, limit: float | None = None,
                       block: K.Block | None = None) -> torch.Tensor:
    """``x · weightᵀ + act(x2) · weight2ᵀ`` as one launch of the skinny kernel."""
    M, (N, Kd) = x.shape[0], weight.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        K.launch(x, weight, y, Kd, block or dual_candidates(M, N, Kd, weight2.shape[1])[0], activation=activation,
                 limit=_limit(activation, limit), second=(x2, weight2))
    return y


def dual_candidates(rows: int, n: int, k: int, k2: int, mma: bool = False) -> list[K.Block]:
    """The block shapes of :func:`kernels.candidates` for the longer of the two products."""
    return K.candidates(rows, n, max(k, k2), mma)


def _dual_key(x, weight, x2, weight2, activation, limit) -> tuple:
    return K._key(x, weight, None, None, None) + (weight2.shape[1], weight2.dtype, x2.dtype, activation, limit)


def _verify_dual(x, weight, x2, weight2, activation=None, limit=None) -> str | None:
    parts = 1 if activation is None else K.ACTS.get(activation, (0, 0))[1]
    if activation is not None and activation not in K.ACTS:
        return f"unknown activation {activation!r}"
    if x2.dim() != 2 or x2.shape[0] != x.shape[0] or x2.shape[-1] != parts * weight2.shape[-1]:
        return f"x2 needs the rows of x with {parts} x the second weight's in-features"
    if weight2.shape[0] != weight.shape[0]:
        return "the two weights need the same out-features"
    why = K.refusal(x, weight) or K.refusal(x2[:, :weight2.shape[1]], weight2)
    if why is None and dual_choice(x, weight, x2, weight2, activation, limit) is None:
        return "the two ops apart are as fast or faster at this shape (measured)"
    return why


def dual_timings(x, weight, x2, weight2, activation=None, limit=None) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of ``act_linear`` (or ``linear``) then ``linear`` with its sum, each as the op
    chooses (None), against the one launch, on random rows of x's and x2's shapes."""
    from dayzero.ops.registry import call

    xs = torch.randn(x.shape, device=x.device).to(x.dtype)
    x2s = torch.randn(x2.shape, device=x.device).to(x2.dtype)

    def apart(w, w2):
        other = call("linear", x2s, w2) if activation is None else call("act_linear", x2s, w2, None, activation, limit)
        return call("linear", xs, w, add=other)

    apart(weight, weight2)  # the two ops measure their own choices first, eagerly
    mma = K.tensor_cores(x.dtype, weight.dtype) and K.tensor_cores(x2.dtype, weight2.dtype)
    return K.fused_timings((weight, weight2), lambda ws: apart(*ws),
                           lambda ws, b: dual_skinny_linear(xs, ws[0], x2s, ws[1], activation, limit, b),
                           dual_candidates(x.shape[0], weight.shape[0], weight.shape[1], weight2.shape[1], mma))


def dual_choice(x, weight, x2, weight2, activation=None, limit=None) -> K.Block | None:
    """The one launch's block shape when it ran faster than the two ops apart (measured at the key's first call,
    on the key's bucket of rows), else None."""
    key = _dual_key(x, weight, x2, weight2, activation, limit)
    xs, x2s = K.bucket_rows(x, key[0]), K.bucket_rows(x2, key[0])
    return K.measure_once(_DUAL, key, x.device, lambda: K.fused_choice(
        f"dual_linear {key[0]} x [{weight.shape[0]}, {weight.shape[1]} + {weight2.shape[1]}]",
        dual_timings(xs, weight, x2s, weight2, activation, limit)), "dual_linear")


@register("dual_linear", "cuda", verifier=_verify_dual,
          note="both products in one skinny linear launch "
               "(1-8 rows, up to 64 on the tensor cores, where measured faster than the ops apart)")
def dual_linear(x: torch.Tensor, weight: torch.Tensor, x2: torch.Tensor, weight2: torch.Tensor,
                activation: str | None = None, limit: float | None = None) -> torch.Tensor:
    return dual_skinny_linear(x, weight, x2, weight2, activation, limit,
                              _DUAL[_dual_key(x, weight, x2, weight2, activation, limit)])


# --- sigmoid_gate_linear: gated attention's output gate inside its output projection --------------------------
_GATE: dict[tuple, K.Block | None] = {}  # key -> the fused launch's block shape, None: the two ops apart


def gate_skinny_linear(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       block: K.Block | None = None) -> torch.Tensor:
    """``(x * sigmoid(gate))`` [M, H, V] as [M, H*V] rows times weightᵀ, one launch."""
    M, (N, Kd) = x.shape[0], weight.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M:
        K.launch(x, weight, y, Kd, block or K.candidates(M, N, Kd)[0], bias=bias, sigmoid_gate=gate)
    return y


def _gate_key(x, gate, weight, bias) -> tuple:
    return K._key(_rows(x), weight, bias, None, None) + (x.shape[1], gate.shape[2], gate.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A tensor shaped like x's heads side by side, [M, H*V], for the linear's key and refusals (shapes only)."""
    return x.new_empty((1, x.shape[1] * x.shape[2])).expand(x.shape[0], -1)


def _verify_gate(x, gate, weight, bias=None) -> str | None:
    if x.dim() != 3 or gate.dim() != 3 or gate.shape[:2] != x.shape[:2] or gate.shape[2] not in (1, x.shape[2]):
        return "x [rows, heads, V] with a gate [rows, heads, V] or [rows, heads, 1]"
    if x.stride(2) != 1 or gate.dtype not in K.DTYPES:
        return "x needs contiguous channels and the gate bf16, fp16 or fp32"
    why = K.refusal(_rows(x), weight, bias)
    if why is None and gate_choice(x, gate, weight, bias) is None:
        return "the gate kernel and the linear apart are as fast or faster at this shape (measured)"
    return why


def gate_timings(x, gate, weight, bias=None) -> dict[K.Block | None, float]:
    """:func:`kernels.fused_timings` of the gate kernel then the linear's own choice (None) against the fused
    launch, on random rows and gates of x's and the gate's shapes."""
    from dayzero.ops.activation.kernels import sigmoid_gate

    M = x.shape[0]
    xs = torch.randn(x.shape, device=x.device).to(x.dtype)
    gs = torch.randn(gate.shape, device=x.device).to(gate.dtype)
    apart_block = K.measured_choice(xs.view(M, -1), weight, bias)
    return K.fused_timings(
        weight, lambda w: K.chosen_linear(sigmoid_gate(xs, gs).view(M, -1), w, bias, None, None, apart_block),
        lambda w, b: gate_skinny_linear(xs, gs, w, bias, b),
        K.candidates(M, weight.shape[0], weight.shape[1], K.tensor_cores(x.dtype, weight.dtype)))


def gate_choice(x, gate, weight, bias=None) -> K.Block | None:
    """The fused launch's block shape when it ran faster than the gate apart (measured at the key's first call, on
    the key's bucket of rows), else None."""
    key = _gate_key(x, gate, weight, bias)
    xs, gs = K.bucket_rows(x, key[0]), K.bucket_rows(gate, key[0])
    return K.measure_once(_GATE, key, x.device, lambda: K.fused_choice(
        f"sigmoid_gate_linear {key[0]} x [{key[1]}, {key[2]}]", gate_timings(xs, gs, weight, bias)),
        "sigmoid_gate_linear")


@register("sigmoid_gate_linear", "cuda", verifier=_verify_gate,
          note="the output gate inside the skinny linear kernel "
               "(1-8 rows, up to 64 on the tensor cores, where measured faster than apart)")
def sigmoid_gate_linear(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    return gate_skinny_linear(x, gate, weight, bias, _GATE[_gate_key(x, gate, weight, bias)])
