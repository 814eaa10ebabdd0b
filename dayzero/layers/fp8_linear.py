"""Linears whose weight stays in block-scaled FP8 (the DeepSeek-V3 checkpoint layout, ``dayzero.quant.fp8``):
:class:`BlockFp8Linear`, the swap of a model's linears for them, and a dense view of any linear's weight."""
from __future__ import annotations

import torch

from dayzero.distributed import tp_all_reduce
from dayzero.layers.parallel import PLAIN_LINEARS, ColumnParallelLinear, RowParallelLinear, gather_logits
from dayzero.quant.fp8 import FP8, TILE, dequantize_fp8_blocks


class BlockFp8Linear(torch.nn.Module):
    """A linear layer whose weight stays in FP8 with a per-tile ``weight_scale_inv`` and is dequantised
    tile by tile when it runs (the DeepSeek-V3 checkpoint layout).

    Under tensor parallelism it takes the place of a column- or row-parallel linear (:meth:`like`): ``weight``
    and ``weight_scale_inv`` are cut along the same dim by the same :class:`~dayzero.layers.parallel.Shard`, which
    needs every rank's piece of each part to be whole 128-wide tiles; a column-parallel one gathers its output
    when the linear it replaces did, a row-parallel one sums the ranks' partial outputs, then adds the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, device=None, parallel=None,
                 kind: str = "plain", gather: bool = False, full_out_features: int | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(
            torch.empty(-(-out_features // TILE), -(-in_features // TILE), dtype=torch.float32, device=device), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.empty(out_features, device=device)) if bias else None
        self.parallel, self.kind, self.gather = parallel, kind, gather
        self.full_out_features = full_out_features or out_features

    @classmethod
    def like(cls, linear: torch.nn.Linear, name: str) -> "BlockFp8Linear":
        """The FP8 form of ``linear`` (plain, or a column- / row-parallel slice; ``name`` for the errors)."""
        kind = {ColumnParallelLinear: "column", RowParallelLinear: "row"}.get(type(linear), "plain")
        fp8 = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device,
                  getattr(linear, "parallel", None), kind, getattr(linear, "gather", False),
                  getattr(linear, "full_out_features", None))
        shards = getattr(linear, "shards", {})
        if "weight" in shards:
            cut = shards["weight"]
            local = fp8.weight.shape[cut.dim] // cut.parts
            if local % TILE:
                raise ValueError(f"tp={cut.size} leaves {name} {local} {'output' if cut.dim == 0 else 'input'} "
                                 f"features per rank{' per part' if cut.parts > 1 else ''}, not whole {TILE}-wide "
                                 "block-FP8 tiles; use a tp that keeps them whole")
            fp8.shards = {"weight": cut, "weight_scale_inv": cut} | ({"bias": shards["bias"]} if "bias" in shards else {})
        return fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_fp8_blocks(self.weight, self.weight_scale_inv, x.dtype)
        if self.kind == "row":
            y = tp_all_reduce(torch.nn.functional.linear(x, w), self.parallel)
            return y if self.bias is None else y + self.bias
        y = torch.nn.functional.linear(x, w, self.bias)
        if self.kind == "column" and self.gather:
            return gather_logits(y, self.full_out_features, self.parallel)
        return y


def dense_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight of a plain or block-FP8 linear as a dense tensor (for ops that read weights directly): a plain
    weight as it is; block-FP8 tiles dequantised into ``dtype`` once and kept, again only after the weight or
    its scales change (their in-place version counters move), so no step re-derives them."""
    if not isinstance(linear, BlockFp8Linear):
        return linear.weight
    key = (linear.weight._version, linear.weight_scale_inv._version, dtype)
    if getattr(linear, "_dense_key", None) != key:
        linear._dense = dequantize_fp8_blocks(linear.weight, linear.weight_scale_inv, dtype)
        linear._dense_key = key
    return linear._dense


# linears that stay in high precision whatever the checkpoint: router, LM head, indexer head weights,
# shared-expert gate (ARCHITECTURE.md 4). Globs over module paths; ``*`` is one path component.
KEEP_HIGH = ("lm_head", "mlp.gate", "weights_proj", "shared_expert_gate")


def _in(name: str, pattern: str) -> bool:
    """Whether ``pattern`` names ``name`` or one of its parents (anywhere along the dotted path)."""
    import re

    rx = re.escape(pattern).replace(r"\*", "[^.]+")
    return re.fullmatch(rf"(.*\.)?{rx}(\..*)?", name) is not None


def convert_linears_to_fp8(model: torch.nn.Module, exclude: tuple[str, ...] = ()) -> list[str]:
    """Swap every linear of ``model`` (plain, column- or row-parallel) not named by ``KEEP_HIGH`` or ``exclude``
    (the checkpoint's ``modules_to_not_convert``) for a :class:`BlockFp8Linear`; returns the swapped module names.
    A tensor-parallel cut that splits 128-wide tiles raises ``ValueError`` naming the module."""
    swapped = []
    for name, mod in list(model.named_modules()):
        if (type(mod) not in (*PLAIN_LINEARS, ColumnParallelLinear, RowParallelLinear)
                or any(_in(name, p) for p in (*KEEP_HIGH, *exclude))):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, BlockFp8Linear.like(mod, name))
        swapped.append(name)
    return swapped
