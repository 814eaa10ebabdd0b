"""The flat batch of one engine step: every scheduled token of every sequence in one list.

It has two halves. :class:`StepPlan` is what the scheduler decided, on the host: sequence b owns rows
``query_start[b]:query_start[b+1]``, its tokens have positions ``seq_start[b] .. seq_lens[b]-1``
(``seq_start`` = tokens already in the cache before this step). The device tensors of
:class:`ForwardBatch` say the same to the ops, on the device: token ids, positions, the cache slot of every
new row (``slot_mapping``: slot = block_id * block_size + offset), one block table per sequence, the
sequence's state slot for linear-attention layers, ``cu_seqlens`` and ``fresh`` (sequences starting at
position 0, whose states start from zero). Sliding-window layers with a pool of their own read theirs through
:meth:`ForwardBatch.group` (the same batch with that pool's slot mapping and block tables).

The contract between a batch and the ops: an op with a device implementation reads only the device tensors
and the step's *shape* (``num_tokens``, ``num_seqs``, ``is_decode``, the block-table width): those are fixed
for a captured CUDA graph, the host lengths are not. Only reference implementations may read the host
lengths (``plan.seq_lens``, :meth:`ForwardBatch.rows`, :meth:`ForwardBatch.key_slots`); a captured step's
plan has none, so a reference that sneaks into a capture fails at once instead of replaying stale lengths.

Rows past the real batch (a decode step padded to a captured size) read and write only the reserved null
block 0 and the reserved null state slot 0, start fresh at position 0, and are never sampled.

:meth:`ForwardBatch.split` cuts an eager step into batches of consecutive sequences (pipeline micro-batches):
every op sees a whole batch of its own, and the parts' outputs, in order, are the step's rows.
"""
from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass

import torch


class HostLengthsUnavailable(RuntimeError):
    """A captured step's plan has no host lengths: ops run inside a CUDA graph must not read them."""


@dataclass(frozen=True)
class StepPlan:
    query_start: tuple[int, ...]  # [B+1] host copy of cu_seqlens
    seq_start_: tuple[int, ...] | None  # [B] tokens in the cache before this step (None in a captured step)
    seq_lens_: tuple[int, ...] | None  # [B] tokens in the cache after this step (None in a captured step)
    block_size: int
    num_real: int | None = None  # sequences that are not padding (None: all)

    @property
    def num_seqs(self) -> int:
        return len(self.query_start) - 1

    @property
    def num_tokens(self) -> int:
        return self.query_start[-1]

    @property
    def max_query_len(self) -> int:
        return max((b - a for a, b in zip(self.query_start, self.query_start[1:])), default=0)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings one token (the recurrent forms, absorbed MLA, graph-capturable)."""
        return self.max_query_len == 1

    def _host(self, name: str, v):
        if v is None:
            raise HostLengthsUnavailable(
                f"plan.{name} is not available inside a captured decode step: a device implementation must read "
                "the batch's device tensors (positions, block_tables, cu_seqlens), not host lengths")
        return v

    @property
    def seq_start(self) -> tuple[int, ...]:
        return self._host("seq_start", self.seq_start_)

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self._host("seq_lens", self.seq_lens_)


class ForwardBatch:
    """The device half of a step, with its :class:`StepPlan`.

    ``ForwardBatch(input_ids, positions, query_start, seq_start, seq_lens, slot_mapping, block_tables,
    state_slots, logits_indices, block_size)`` builds a batch from host lists (tests, tools); the model
    runner passes ``cu_seqlens``, ``fresh`` and ``topk_buffer`` as views of its persistent device buffers.
    """

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor, query_start, seq_start, seq_lens,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, state_slots: torch.Tensor,
                 logits_indices: torch.Tensor, block_size: int, *, cu_seqlens: torch.Tensor | None = None,
                 fresh: torch.Tensor | None = None, topk_buffer: torch.Tensor | None = None,
                 num_real: int | None = None, window_group: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.plan = StepPlan(tuple(query_start), None if seq_start is None else tuple(seq_start),
                             None if seq_lens is None else tuple(seq_lens), block_size, num_real)
        dev = input_ids.device
        self.input_ids = input_ids  # [T] int64
        self.positions = positions  # [T] int64
        self.slot_mapping = slot_mapping  # [T] int64
        self.block_tables = block_tables  # [B, W] int64, 0 (the null block) where unused
        self.state_slots = state_slots  # [B] int64, 0 (the null slot) for padding rows
        self.logits_indices = logits_indices  # [S] int64 rows whose next-token logits are sampled
        # S when those rows are 0 .. S-1 in order (a decode step's), known on the host: the runner takes the first S
        # rows as a view, no gather kernel; None otherwise
        self.leading_samples: int | None = None
        if cu_seqlens is None:
            cu_seqlens = torch.tensor(self.plan.query_start, dtype=torch.int64, device=dev)
        if fresh is None:
            fresh = torch.tensor([s == 0 for s in self.plan.seq_start], dtype=torch.bool, device=dev)
        self.cu_seqlens = cu_seqlens  # [B+1] int64, device copy of query_start
        self.fresh = fresh  # [B] bool
        self._topk_buffer = topk_buffer  # [T, >= topk] int64, preallocated for the DSA selection
        # The DSA selection of this step: [T, topk] key indices (positions in the sequence, -1 padded) written
        # by the first layer that runs its indexer, read by the shared-index layers after it; None: dense.
        self.selection: torch.Tensor | None = None
        self.selection_set = False  # host flag: an indexer layer ran in this step
        # what a forward pass computes once for all its layers (cleared as each pass starts, a captured one
        # too): cos/sin of the positions per rotary frequency set, the slots to zero for fresh sequences
        self.memo: dict = {}
        # the captured shape this step replays (decode: (batch size, table width); prefill: (rows, sequences,
        # width)) and the graph set holding it; None: the step runs eagerly
        self.graph: tuple[int, ...] | None = None
        self.graph_set = None
        # images: the step's image rows (dayzero.multimodal.inputs.StepImages), set by the engine; None: text only.
        # rope_positions (multimodal RoPE models): [3, T] (t, h, w) positions in steps that cover an image prompt's
        # positions, else [T] (index + the sequence's rope delta, from a step buffer); None for other models
        self.images = None
        self.rope_positions: torch.Tensor | None = None
        self._key_slots: list[torch.Tensor] | None = None
        # the windowed layers' own pool (CachePlan.window_pool): its (slot_mapping [T], block_tables [B, W])
        self.window_group = window_group

    def group(self, g: int) -> "ForwardBatch":
        """The batch as the layers of block group ``g`` see it: group 0 is this batch; group 1 (sliding-window
        layers with a pool of their own) the same step with that pool's slot mapping and block tables, made
        once per forward pass and sharing the pass's memo."""
        if g == 0:
            return self
        view = self.memo.get(("group", g))
        if view is None:
            if self.window_group is None:
                raise ValueError(f"block group {g} has no tables in this batch (built without a window pool)")
            view = self.memo[("group", g)] = copy.copy(self)
            view.slot_mapping, view.block_tables = self.window_group
            view.window_group, view._key_slots = None, None
        return view

    # --- the step's shape (fixed for a captured graph) ---------------------------------------------
    @property
    def num_seqs(self) -> int:
        return self.plan.num_seqs

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_query_len(self) -> int:
        return self.plan.max_query_len

    @property
    def host_lengths(self) -> bool:
        """Whether the plan holds the host lengths; a captured step's has none (its ops read the device tensors,
        and an op that eagerly builds something from the lengths on the host builds it on the device instead)."""
        return self.plan.seq_start_ is not None

    @property
    def is_decode(self) -> bool:
        return self.plan.is_decode

    @property
    def block_size(self) -> int:
        return self.plan.block_size

    @property
    def key_width(self) -> int:
        """Keys per sequence the block tables can address: an upper bound of every sequence's length."""
        return self.block_tables.shape[1] * self.plan.block_size

    @property
    def seq_of_row(self) -> torch.Tensor:
        """[T] int64: the sequence (row of ``block_tables``) each query row belongs to, found on the device from
        ``cu_seqlens`` (no host read; computed once per step, shared by layers)."""
        # in the pass's memo, not on the batch: a captured pass must compute it inside the capture (a tensor kept
        # from the warm pass before it would be freed, and read by every replay)
        seq_of_row = self.memo.get("seq_of_row")
        if seq_of_row is None:
            rows = torch.arange(self.num_tokens, device=self.cu_seqlens.device)
            seq_of_row = self.memo["seq_of_row"] = torch.searchsorted(self.cu_seqlens[1:], rows, right=True)
        return seq_of_row

    def split(self, parts: int) -> list["ForwardBatch"] | None:
        """The step as up to ``parts`` batches of consecutive sequences with about equal rows, whose outputs
        concatenated in order are the step's; None when it stays whole: fewer than two sequences, no host lengths
        (a captured step), padding sequences, or image inputs (their rows index the whole step). A part's
        ``logits_indices`` are empty: the runner samples from the concatenated output."""
        B, qs = self.num_seqs, self.plan.query_start
        padded = self.plan.num_real not in (None, B)
        if parts < 2 or B < 2 or not self.host_lengths or padded or self.images is not None:
            return None
        bounds = [0]
        for i in range(1, parts):  # the sequence boundary at or after each equal share of the rows
            b = bisect.bisect_left(qs, qs[-1] * i / parts, bounds[-1] + 1, B - 1)
            if bounds[-1] < b < B:
                bounds.append(b)
        bounds.append(B)
        if len(bounds) < 3:
            return None
        return [self._part(a, b) for a, b in zip(bounds, bounds[1:])]

    def _part(self, a: int, b: int) -> "ForwardBatch":
        """Sequences a .. b-1 as a batch of their own."""
        qs = self.plan.query_start
        rows = slice(qs[a], qs[b])
        part = ForwardBatch(
            self.input_ids[rows], self.positions[rows], [q - qs[a] for q in qs[a:b + 1]], self.plan.seq_start[a:b],
            self.plan.seq_lens[a:b], self.slot_mapping[rows], self.block_tables[a:b], self.state_slots[a:b],
            self.logits_indices[:0], self.plan.block_size, fresh=self.fresh[a:b],
            window_group=None if self.window_group is None else (self.window_group[0][rows], self.window_group[1][a:b]))
        if self.rope_positions is not None:  # [T] or [3, T]
            part.rope_positions = self.rope_positions[..., rows]
        return part

    def topk_buffer(self, topk: int) -> torch.Tensor:
        """The step's [T, topk] selection buffer (a view of the runner's persistent one when it gave one)."""
        buf = self._topk_buffer
        if buf is None or buf.shape[1] < topk or buf.shape[0] < self.num_tokens:
            buf = self._topk_buffer = torch.empty(self.num_tokens, topk, dtype=torch.int64, device=self.input_ids.device)
        return buf[: self.num_tokens, :topk]

    # --- host lengths (reference implementations only) ---------------------------------------------
    @property
    def query_start(self) -> tuple[int, ...]:
        return self.plan.query_start

    @property
    def seq_start(self) -> tuple[int, ...]:
        return self.plan.seq_start

    @property
    def seq_lens(self) -> tuple[int, ...]:
        return self.plan.seq_lens

    def rows(self, b: int) -> slice:
        return slice(self.plan.query_start[b], self.plan.query_start[b + 1])

    def entry_slots(self, b: int | slice, stride: int, entries: torch.Tensor) -> torch.Tensor:
        """Slots of sequence b's compressed entries ``entries`` in a pool of one row per ``stride`` tokens:
        entry w (tokens w·stride ..) is row ``(w·stride mod block_size) // stride`` of the block of token w·stride.
        ``b=slice(None)`` gives every sequence's [B, len(entries)] (``entries`` may also be [B, N], one row per
        sequence); entries past a sequence's blocks read the last column of its table (padding for the caller
        to mask)."""
        bs = self.plan.block_size
        per_block = -(-bs // stride)
        pos = entries * stride
        col = (pos // bs).clamp(min=0, max=self.block_tables.shape[1] - 1)
        table = self.block_tables[b]
        blocks = table.gather(-1, col) if col.dim() == 2 else table[..., col]
        return blocks * per_block + (pos % bs) // stride

    def key_slots(self, b: int) -> torch.Tensor:
        """Cache slots of tokens 0..seq_lens[b]-1 of sequence b (computed once per step, shared by layers)."""
        if self._key_slots is None:
            self._key_slots = []
            for i, n in enumerate(self.plan.seq_lens):
                pos = torch.arange(n, device=self.block_tables.device)
                self._key_slots.append(self.block_tables[i, pos // self.plan.block_size] * self.plan.block_size
                                       + pos % self.plan.block_size)
        return self._key_slots[b]

    def table_slots(self) -> torch.Tensor:
        """[B, key_width] slots of key positions 0 .. key_width-1 of every sequence, through its block table
        (positions past a sequence's length land in its padding blocks; the caller masks them)."""
        bs = self.plan.block_size
        off = torch.arange(bs, device=self.block_tables.device)
        return (self.block_tables[:, :, None] * bs + off).reshape(self.block_tables.shape[0], -1)
