"""The batch and the caches of a training forward: whole fresh sequences, packed flat.

:class:`TrainBatch` is a :class:`~dayzero.engine.batch.ForwardBatch` whose sequences all start at position 0
and are computed whole in one step: row ``cu_seqlens[b] + j`` is token j of sequence b. Sequences are packed
in order of length and cut into :class:`Bucket` s of similar length, so that the training attention runs a few
padded ``[B, L]`` calls instead of one per sequence.

The caches are functional (:class:`RowsPool`): a layer's ``write_rows`` makes the rows it writes *the* pool
(nothing is written in place, so autograd sees every tensor once), with block size 1 and each sequence's block
table its own token rows, so slot = row and a reference op that gathers keys through the block tables reads
exactly these rows. State caches (KDA's recurrent state and conv windows) are ``None``: the training ops start
every sequence from zero state and write nothing back. :func:`train_caches` binds them for a block and gives
the inference caches back afterwards.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dayzero.cache.spec import PagedSpec, parts
from dayzero.engine.batch import ForwardBatch
from dayzero.ops.kda.chunk_batched import length_runs


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queue: on CUDA through pinned memory and an
    asynchronous copy (a copy from pageable memory, or a blocking one, synchronises with the stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for an integer ``index`` of any shape, through ``index_select``: its gradient is an atomic
    ``index_add_``, where ``x[index]``'s sorts the indices and runs serially over repeats (the padding cells and
    the experts' spare cells repeat one row thousands of times: seconds a step)."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


class RowsPool:
    """A paged pool that holds one step's rows: ``write`` replaces them (slots are the rows 0..T-1 of a
    :class:`TrainBatch`), ``read`` gathers them by slot."""

    def __init__(self, row: tuple[int, ...]):
        self.row = row
        self.rows: torch.Tensor | None = None  # [T, *row]

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        self.rows = rows

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return take(self.rows, slots)

    @property
    def shape(self) -> tuple[int, ...]:  # [blocks, rows per block (1), *row], as a paged pool
        return (0 if self.rows is None else self.rows.shape[0], 1, *self.row)

    def clear(self) -> None:
        self.rows = None


@dataclass(frozen=True)
class Bucket:
    """Sequences ``seqs`` (a range of the batch's sequences) occupying flat rows ``start:end``; padded to
    ``width`` tokens each they form ``[len(seqs), width]``: ``index`` [B, width] gives each padded cell's row
    counted from ``start`` (padding repeats the sequence's last row, after every real token, so causal attention
    never reads it) and ``cells`` [end - start] each real row's cell in the flattened padded layout."""

    seqs: range
    start: int
    end: int
    width: int
    index: torch.Tensor  # [B, width] int64
    cells: torch.Tensor  # [end - start] int64

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """This bucket's flat rows [end - start, ...] (its piece of :meth:`TrainBatch.split`) -> [B, width, ...]."""
        return take(x, self.index)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[B, width, ...] -> this bucket's flat rows [end - start, ...]."""
        return take(y.reshape(-1, *y.shape[2:]), self.cells)


def make_buckets(lens: list[int], device, growth: float = 1.5) -> list[Bucket]:
    """Cut sequences of non-decreasing lengths ``lens`` into buckets whose longest sequence is at most ``growth``
    times their shortest (so padding stays under that factor)."""
    if any(b < a for a, b in zip(lens, lens[1:])):
        raise ValueError("sequences must be packed in order of length")
    out, start = [], 0
    for run in length_runs(lens, growth):
        seq_lens = lens[run.start:run.stop]
        width = seq_lens[-1]
        starts = torch.tensor([0] + seq_lens[:-1], dtype=torch.int64).cumsum(0)  # within the bucket
        n = torch.tensor(seq_lens, dtype=torch.int64)
        j = torch.arange(width, dtype=torch.int64)
        index = starts[:, None] + torch.minimum(j[None, :], n[:, None] - 1)
        cells = (j[None, :] < n[:, None]).flatten().nonzero()[:, 0]  # real cells, row by row
        end = start + sum(seq_lens)
        out.append(Bucket(run, start, end, width, to_device(index, device), to_device(cells, device)))
        start = end
    return out


class TrainBatch(ForwardBatch):
    """Whole sequences from position 0, in order of length; ``losses`` collects the auxiliary losses the
    training ops compute during the forward (e.g. ``"indexer_kl"``), ``sparse`` says whether DSA layers attend
    over their indexer's top-k (False: dense attention, the indexer's warm-up)."""

    def __init__(self, input_ids: torch.Tensor, lens: list[int], *, sparse: bool = True,
                 kl_rows: int = 256, growth: float = 1.5):
        dev = input_ids.device
        if sum(lens) != input_ids.shape[0] or any(n < 1 for n in lens):
            raise ValueError(f"sequence lengths {lens[:8]}... do not pack {input_ids.shape[0]} tokens")
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        # built on the host and copied without waiting (on the device, repeat_interleave would read its output size
        # back, which drains the device's queue at every step)
        cu_host = torch.tensor(cu, dtype=torch.int64)
        seq_host = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
        positions_host = torch.arange(input_ids.shape[0], dtype=torch.int64) - cu_host[seq_host]
        cu_t, seq, positions = (to_device(t, dev) for t in (cu_host, seq_host, positions_host))
        rows = torch.arange(input_ids.shape[0], dtype=torch.int64, device=dev)
        self._lens = list(lens)
        super().__init__(input_ids, positions, cu, [0] * len(lens), lens, rows, torch.empty(0, 0, dtype=torch.int64),
                         torch.zeros(len(lens), dtype=torch.int64, device=dev), rows, 1, cu_seqlens=cu_t,
                         fresh=torch.ones(len(lens), dtype=torch.bool, device=dev))
        self.cu_seqlens_cpu = cu_host  # one host copy a step (fla caches by identity)
        self._tables: torch.Tensor | None = None
        self._seq_of_row = seq
        self.buckets = make_buckets(self._lens, dev, growth)
        self.max_len = max(lens)
        self.sparse = sparse
        self.kl_rows = kl_rows  # query rows per long sequence the indexer's KL is taken over
        self.losses: dict[str, list[torch.Tensor]] = {}
        self.pending_indexer: tuple | None = None  # (q, weights, keys) of the DSA layer running now

    @property
    def seq_of_row(self) -> torch.Tensor:
        """[T]: each row's sequence, made with the batch (a training step is never captured)."""
        return self._seq_of_row

    # block size 1, block table = the sequence's own rows (built only when a reference op asks for it)
    @property
    def block_tables(self) -> torch.Tensor:
        if self._tables is None:
            j = torch.arange(self.max_len, device=self.cu_seqlens.device)
            self._tables = (self.cu_seqlens[:-1, None] + j).clamp(max=self.num_tokens - 1)
        return self._tables

    @block_tables.setter
    def block_tables(self, value) -> None:  # ForwardBatch.__init__ assigns it; the property builds it lazily
        self._tables = None

    @property
    def key_width(self) -> int:
        return self.max_len

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Flat rows [T, ...] -> one piece per bucket (its rows start:end): a split, whose gradient is one
        concatenation, where indexing each bucket out of the whole would add a full-size gradient per bucket."""
        return x.split([b.end - b.start for b in self.buckets])

    def add_loss(self, name: str, value: torch.Tensor) -> None:
        self.losses.setdefault(name, []).append(value)


def _pools(layer, dtype: torch.dtype) -> dict:
    tensors = {}
    for spec in parts(layer.cache_spec(dtype)):
        if isinstance(spec, PagedSpec):
            tensors.update({name: RowsPool(tuple(shape)) for name, (shape, _) in spec.rows.items()})
        else:
            tensors.update(dict.fromkeys(spec.tensors))
    return tensors


@contextlib.contextmanager
def train_caches(model, dtype: torch.dtype = torch.float32):
    """Bind functional caches (:class:`RowsPool`, ``None`` for states) to every cached layer of ``model`` for
    the block; the layers' own caches come back afterwards."""
    layers = [layer for _, layer in model.cached_layers()]
    before = [layer.cache for layer in layers]
    for layer in layers:
        layer.bind_cache(_pools(layer, dtype))
    try:
        yield
    finally:
        for layer, cache in zip(layers, before):
            layer.cache = cache


def clear_caches(model) -> None:
    """Drop the rows the last training step left in its functional caches."""
    for _, layer in model.cached_layers():
        for pool in (layer.cache or {}).values():
            if isinstance(pool, RowsPool):
                pool.clear()
