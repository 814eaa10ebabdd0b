"""Tensor-parallel linears and embedding, and the shard declaration the loader narrows checkpoint tensors by.

At tp=1 the constructors below return a plain :class:`Linear` (an ``nn.Linear`` whose product is the ``linear``
op: a decode step's few rows may take the skinny kernel) / ``nn.Embedding``: same parameter names, same
``state_dict``, the same fast paths (fusion, block-FP8 conversion, fused MLP op). At tp>1 each returns a
subclass holding only this rank's slice, with ``shards`` naming how each parameter is cut:

- :class:`ColumnParallelLinear`: output features split (attention heads, MLP gate/up); its output stays split
  unless ``gather`` (the LM head);
- :class:`RowParallelLinear`: input features split (o_proj, down_proj); the partial outputs are summed by one
  all-reduce, then the bias (whole on every rank) is added once;
- :class:`VocabParallelEmbedding`: vocabulary rows split; a rank looks up the ids it holds, zeros the others,
  and one all-reduce assembles the rows.

A vocabulary that tp does not divide is padded to ``ceil(V / tp)`` rows per rank: the loader zero-fills the
rows past the checkpoint's end and the LM head drops their logits.

A projection whose output is parts of unequal widths, each cut by head (Gated DeltaNet's [q | k | v | z],
Mamba-2's [z | x | B | C | dt], and their convs), declares them (:func:`cut_by_blocks`): the loader reads the
rank's rows of each part and nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from dayzero import ops
from dayzero.distributed import SINGLE, ParallelState, divide, tp_all_gather, tp_all_reduce


@dataclass(frozen=True)
class Shard:
    """A parameter holds piece ``rank`` of ``size`` equal pieces of the full tensor along ``dim`` (the last piece
    padded when ``size`` does not divide the length). With ``parts`` > 1 the full tensor is ``parts`` blocks
    along ``dim`` (a fused [gate; up]) and each block is cut the same way, the rank's pieces kept in order.
    ``experts`` > 0: ``dim`` 0 is a stack of expert slots (``rank`` of ``size`` ep ranks) whose first ``experts``
    the checkpoint fills (the rest hold copies made after loading); a checkpoint tensor may also hold one expert's
    part, which belongs to one rank only. ``inner`` cuts the expert slots' tensors again along another dim (each
    expert's width split over the ranks of an expert-TP group). ``widths``: the full tensor is parts of these
    unequal widths along ``dim`` (a projection's [q | k | v | z] by head), each cut into ``size`` equal pieces and
    the rank's pieces kept in order."""

    dim: int
    rank: int
    size: int
    parts: int = 1
    experts: int = 0
    inner: "Shard | None" = None  # a second cut of the expert slots' tensors (expert TP inside expert groups)
    widths: tuple[int, ...] = ()  # full widths of unequal parts along ``dim`` ([q | k | v | z]), each cut alike

    def span(self, n: int) -> tuple[int, int, int]:
        """For a full length ``n``: (start, length read, length held); held - read rows are padding."""
        per = -(-n // self.size)
        start = min(self.rank * per, n)
        return start, min(per, n - start), per


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same ``state_dict``) whose product goes through the ``linear`` op: on a GPU
    a decode step's 1-8 rows (up to 64 in bf16 or fp16) take the skinny Triton kernel where it measured faster
    than cuBLAS."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.call("linear", x, self.weight, self.bias)


PLAIN_LINEARS = (nn.Linear, Linear)  # one GEMM of the module's own weight: what fusion and FP8 conversion take


def column_linear(in_features: int, out_features: int, bias: bool = False, parallel: ParallelState = SINGLE, *,
                  what: str = "out_features", gather: bool = False, parts: int = 1,
                  shard: Shard | None = None) -> Linear:
    """A linear whose output features are split over tp (``what`` names the setting a bad tp fails to divide);
    ``shard`` overrides the default cut (k/v heads replicated over groups of ranks)."""
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias, parallel, what=what, gather=gather, parts=parts,
                                shard=shard)


def row_linear(in_features: int, out_features: int, bias: bool = False, parallel: ParallelState = SINGLE, *,
               what: str = "in_features") -> Linear:
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel, what=what)


def vocab_embedding(num_embeddings: int, dim: int, parallel: ParallelState = SINGLE) -> nn.Embedding:
    if parallel.tp_size == 1:
        return nn.Embedding(num_embeddings, dim)
    return VocabParallelEmbedding(num_embeddings, dim, parallel)


def lm_head(hidden: int, vocab: int, parallel: ParallelState = SINGLE) -> Linear:
    """The LM head: vocabulary rows split like :func:`vocab_embedding` (so a tied weight has one shape);
    :func:`gather_logits` assembles its output."""
    if parallel.tp_size == 1:
        return Linear(hidden, vocab, bias=False)
    return ColumnParallelLinear(hidden, vocab, False, parallel, gather=True, pad=True)


def gather_logits(logits: torch.Tensor, vocab: int, parallel: ParallelState) -> torch.Tensor:
    """[S, V/tp] per rank -> [S, V] on every rank, padding rows dropped. Identity at tp=1."""
    full = tp_all_gather(logits, parallel)
    return full if full.shape[-1] == vocab else full[..., :vocab]


class ColumnParallelLinear(Linear):
    """``weight`` [out/tp, in], ``bias`` [out/tp]: this rank's output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState, *,
                 what: str = "out_features", gather: bool = False, parts: int = 1, pad: bool = False,
                 shard: Shard | None = None):
        shard = shard or Shard(0, parallel.tp_rank, parallel.tp_size, parts)
        if pad:
            local = shard.span(out_features)[2]
        else:
            if out_features % (shard.size * parts):
                raise ValueError(f"tp={shard.size} does not divide {what}={out_features // parts}")
            local = out_features // shard.size
        super().__init__(in_features, local, bias=bias)
        self.parallel, self.gather, self.full_out_features = parallel, gather, out_features
        self.shards = {"weight": shard} | ({"bias": shard} if bias else {})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [.., out/tp]
        return gather_logits(y, self.full_out_features, self.parallel) if self.gather else y

    def extra_repr(self) -> str:
        s = self.shards["weight"]
        return f"{super().extra_repr()}, tp_rank={s.rank}/{s.size}, gather={self.gather}"


class RowParallelLinear(Linear):
    """``weight`` [out, in/tp]: this rank's input features; ``bias`` [out] whole, added after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState, *,
                 what: str = "in_features"):
        super().__init__(divide(in_features, parallel, what), out_features, bias=bias)
        self.parallel = parallel
        self.shards = {"weight": Shard(1, parallel.tp_rank, parallel.tp_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [.., in/tp], this rank's share of the features -> the whole [.., out] on every rank
        y = tp_all_reduce(ops.call("linear", x, self.weight), self.parallel)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.parallel.tp_rank}/{self.parallel.tp_size}"


class VocabParallelEmbedding(nn.Embedding):
    """``weight`` [ceil(V/tp), D]: the rows of ids [start, start + rows) of this rank."""

    def __init__(self, num_embeddings: int, dim: int, parallel: ParallelState):
        shard = Shard(0, parallel.tp_rank, parallel.tp_size)
        self.start, _, rows = shard.span(num_embeddings)
        super().__init__(rows, dim)
        self.parallel, self.full_num_embeddings = parallel, num_embeddings
        self.shards = {"weight": shard}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)  # ids another rank holds
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # [T, D]
        return tp_all_reduce(x.masked_fill_(outside[..., None], 0), self.parallel)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows from {self.start}, tp={self.parallel.tp_size}"


def fused_product(proj: nn.Module, product: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
                  ) -> torch.Tensor | None:
    """``proj(f(x))`` where ``product(weight, bias)`` computes f and the projection in one op (an activation or a
    norm inside the GEMM): for a plain linear with its own weight and bias, for a row-parallel one with its rank's
    weight, then the sum over ranks and the bias. None for other projections (block-FP8 ones dequantise their own
    weight): the caller runs f and ``proj`` apart."""
    if type(proj) in PLAIN_LINEARS:
        return product(proj.weight, proj.bias)
    if type(proj) is RowParallelLinear:
        y = tp_all_reduce(product(proj.weight, None), proj.parallel)
        return y if proj.bias is None else y + proj.bias
    return None


def parameter_shards(model: nn.Module) -> dict[str, Shard]:
    """Parameter name -> its :class:`Shard`, for every parameter of ``model`` that holds a slice (none at tp=1)."""
    out = {}
    for prefix, mod in model.named_modules():
        for name, shard in getattr(mod, "shards", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out


def cut_by_blocks(blocks: Sequence[int], parallel: ParallelState, what: str) -> Shard | None:
    """The :class:`Shard` of output channels that are parts of the full widths ``blocks`` (in order), each cut
    into tp equal pieces (None at tp=1): the loader reads only the rank's rows of each part."""
    tp = parallel.tp_size
    if tp == 1:
        return None
    if any(b % tp for b in blocks):
        raise ValueError(f"tp={tp} does not divide every part {tuple(blocks)} of {what}")
    return Shard(0, parallel.tp_rank, tp, widths=tuple(blocks))
