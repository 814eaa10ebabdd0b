"""Linears that read the same input, run as one GEMM.

At the few tokens of a decode step a GEMM costs a few microseconds of launch and ramp-up whatever its size, and
a mixer takes several projections from one input: KDA its q, k, v, gate, beta and output-gate down-projections,
MLA its query and latent down-projections with the indexer key and the output gate, LatentMoE its latent
down-projection with the shared expert's gate/up. :func:`fuse` runs such a group as one: the members' weights are
copied into one [sum of N, K] weight and each member's weight becomes a row slice (a view) of it, so their names,
loading rules and ``state_dict`` stay as they were and an in-place load (``load_state_dict``) still reaches the
fused weight. Only plain linears (``nn.Linear`` or :class:`~dayzero.layers.parallel.Linear`, or column-parallel
ones that keep their output split: a rank then fuses its own shards) of one dtype and device, all with biases or
none, fuse; a group with a quantised member (block FP8) keeps its separate linears. Moving the model after fusing
leaves the fused weight behind (the next forward then fails on the device mismatch), so the engine fuses on the
final device.
"""
from __future__ import annotations

import torch
from torch import nn

from dayzero import ops
from dayzero.ops.static import mark_static
from dayzero.layers.parallel import PLAIN_LINEARS, ColumnParallelLinear


class FusedLinear(nn.Module):
    """The one GEMM of a fused group; ``forward`` gives each member's output, a column slice of one result."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, widths: list[int], members: list[str]):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.widths, self.members = widths, members
        # plain attributes, not parameters: the member linears own the (viewed) parameters
        object.__setattr__(self, "weight", mark_static(weight))
        object.__setattr__(self, "bias", bias)

    def forward(self, x: torch.Tensor, split: bool = True) -> tuple[torch.Tensor, ...] | torch.Tensor:
        """Each member's output (column slices of one result), or with ``split=False`` the whole [.., sum N]."""
        y = ops.call("linear", x, self.weight, self.bias)  # a decode step's few rows: maybe the skinny kernel
        return y.split(self.widths, dim=-1) if split else y

    def extra_repr(self) -> str:
        return f"{' + '.join(self.members)}: in_features={self.in_features}, out_features={self.out_features}"


@torch.no_grad()
def fuse(owner: nn.Module, name: str, members: list[str]) -> bool:
    """Register ``owner.<name>``, the :class:`FusedLinear` of the linears at ``members`` (paths under ``owner``),
    when they can fuse; otherwise remove any earlier one. Returns whether it fused."""
    if name in owner._modules:
        del owner._modules[name]
    lins = [owner.get_submodule(m) for m in members]
    if len(lins) < 2 or not all(local_gemm(lin) for lin in lins):
        return False
    w0 = lins[0].weight
    if any(lin.weight.dtype != w0.dtype or lin.weight.device != w0.device or lin.in_features != lins[0].in_features
           or (lin.bias is None) != (lins[0].bias is None) for lin in lins):
        return False
    weight = concat_as_views(lins, "weight")
    bias = concat_as_views(lins, "bias") if lins[0].bias is not None else None
    owner.add_module(name, FusedLinear(weight, bias, [lin.out_features for lin in lins], members))
    return True


def local_gemm(lin: nn.Module) -> bool:
    """Whether ``lin``'s forward is one GEMM of its own weight and nothing else (no collective, no dequantising)."""
    return type(lin) in PLAIN_LINEARS or (type(lin) is ColumnParallelLinear and not lin.gather)


@torch.no_grad()
def concat_as_views(modules: list[nn.Module], attr: str) -> torch.Tensor:
    """One tensor of the modules' ``attr`` parameters concatenated along dim 0, each parameter replaced by its
    slice (a view) of it: an in-place load of a member still reaches the whole."""
    params = [getattr(m, attr) for m in modules]
    whole = torch.cat(params)
    start = 0
    for m, p in zip(modules, params):
        setattr(m, attr, nn.Parameter(whole[start:start + p.shape[0]], requires_grad=p.requires_grad))
        start += p.shape[0]
    return whole


def project(owner: nn.Module, name: str, members: list[str], x: torch.Tensor,
            projected: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Each member linear of ``owner`` applied to ``x``: one GEMM when :func:`fuse` fused them, else one each.
    ``projected``: that GEMM's output when the caller computed it (the decoder layer, with the input norm)."""
    fused = owner._modules.get(name)
    if projected is not None:
        return projected.split(fused.widths, dim=-1)
    if fused is not None:
        return fused(x)
    return tuple(owner.get_submodule(m)(x) for m in members)
