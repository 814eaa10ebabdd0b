"""The model runner: owns the model, its cache tensors and the step's persistent device buffers, turns a
schedule into a flat batch, runs the forward pass (eagerly, or by replaying a captured decode graph) and
returns the logits of the sequences to sample."""
from __future__ import annotations

import logging

import torch

from dayzero.cache.manager import CacheManager
from dayzero.cache.planner import CachePlan
from dayzero.cache.spec import PagedSpec, allocate, parts
from dayzero.engine.batch import ForwardBatch
from dayzero.engine.host_copy import to_device
from dayzero.engine.scheduler import ScheduledSeq
from dayzero.engine.step_buffers import StepBuffers
from dayzero.layers.rotary import RotaryEmbedding

log = logging.getLogger("dayzero")

NULL_BLOCK = NULL_SLOT = 0  # what padding rows read and write (never handed to a sequence)


class ModelRunner:
    def __init__(self, model, device: torch.device, cache_dtype: torch.dtype, kv_cache_dtype: str = "auto",
                 index_cache_dtype: str = "auto"):
        self.model = model
        self.device = device
        self.cache_dtype = cache_dtype
        self.kv_cache_dtype, self.index_cache_dtype = kv_cache_dtype, index_cache_dtype
        self.layers = model.cached_layers()
        self.layer_specs = [parts(layer.cache_spec(cache_dtype)) for _, layer in self.layers]
        self.specs = [s for specs in self.layer_specs for s in specs]  # every spec, for planning
        self.buffers: StepBuffers | None = None
        # positions a step may hold (the engine's longest sequence): what the RoPE tables were reserved for
        self.max_positions: int | None = None
        self.graphs = None  # DecodeGraphs once captured
        self.prefill_graphs = None  # PrefillGraphs once captured
        # steps run, by kind ("decode": one row per sequence; "prefill": any other) and how ("graph": replayed)
        self.step_counts = {(kind, how): 0 for kind in ("decode", "prefill") for how in ("graph", "eager")}
        self._workspaces: list | None = None
        self.state_tensors: list[torch.Tensor] = []
        self.host_copies = None  # the prefix cache's host tier (HostCopies), whose copies state copies and steps wait for
        self.groups = 1  # block groups: 2 when windowed layers have a pool of their own (allocate_cache)
        # the widest DSA selection a layer writes: the width of the step's selection buffer
        self.topk = max((getattr(l, "selection_width", 0) for _, l in self.layers), default=0)
        # multimodal RoPE (Qwen3-VL, Qwen3.5): each step also writes the rotary positions (index + rope delta)
        self.mrope = any(isinstance(m, RotaryEmbedding) and m.axes is not None for m in model.modules())

    def allocate_cache(self, plan: CachePlan) -> None:
        self.state_tensors = []  # every state tensor of every layer: rows are slots, the null slot, snapshots
        self.block_tensors = []  # every paged tensor of the first block group: [num_blocks, ...] (quantised: data, scale)
        self.window_block_tensors = []  # the same of the windowed layers' own pool (plan.window_pool)
        self.groups = 1 + bool(plan.window_pool)
        if self.buffers is not None and self.buffers.groups != self.groups:
            self.buffers = None  # reserved for another block-group layout
        for (_, layer), specs in zip(self.layers, self.layer_specs):
            tensors = {}
            layer.cache_group = 0
            for spec in specs:
                own_pool = isinstance(spec, PagedSpec) and spec.window is not None and plan.window_pool is not None
                # state tensors: the null slot 0, the plan's slots, then the prefix-cache snapshots
                count = plan.state_rows if not isinstance(spec, PagedSpec) else plan.window_pool[1] if own_pool else plan.num_blocks
                part = allocate(spec, count, plan.block_size, self.device, self.kv_cache_dtype, self.index_cache_dtype)
                if not isinstance(spec, PagedSpec):
                    self.state_tensors += part.values()
                else:
                    paged = [t for p in part.values() for t in ((p,) if isinstance(p, torch.Tensor) else (p.data, p.scale))]
                    (self.window_block_tensors if own_pool else self.block_tensors).extend(paged)
                    layer.cache_group = int(own_pool)
                tensors.update(part)
            layer.bind_cache(tensors)

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copy state rows (source, destination) in every state tensor: prefix-cache snapshots taken from a
        sequence's slot after a step, or restored into a new sequence's slot before its first one."""
        if not pairs or not self.state_tensors:
            return
        rows = [r for pair in pairs for r in pair]
        if self.host_copies is not None:  # rows on their way to or from host memory
            self.host_copies.before_states(rows)
        src = to_device([a for a, _ in pairs], torch.int64, self.device)
        dst = to_device([b for _, b in pairs], torch.int64, self.device)
        for t in self.state_tensors:
            t.index_copy_(0, dst, t.index_select(0, src))
        if self.host_copies is not None:
            self.host_copies.states_copied(rows)

    def reserve_buffers(self, max_tokens: int, max_seqs: int, max_blocks: int) -> None:
        """Allocate the persistent step buffers for steps of up to these sizes."""
        self.buffers = StepBuffers(self.device, max_tokens, max_seqs, max_blocks, self.topk, self.groups)

    def _buffers_for(self, tokens: int, seqs: int, blocks: int) -> StepBuffers:
        buf = self.buffers
        if buf is None or not buf.fits(tokens, seqs, blocks):
            if self.graphs is not None or self.prefill_graphs is not None:
                raise RuntimeError(f"a step of {tokens} tokens, {seqs} sequences and {blocks} blocks exceeds the buffers "
                                   "the CUDA graphs were captured with")
            grow = (lambda have, need: max(have, need)) if buf is not None else (lambda have, need: need)
            self.reserve_buffers(grow(buf.max_tokens if buf else 0, tokens), grow(buf.max_seqs if buf else 0, seqs),
                                 grow(buf.max_blocks if buf else 0, blocks))
        return self.buffers

    def build_batch(self, scheduled: list[ScheduledSeq], cache: CacheManager, eager: bool = False,
                    pending: tuple[list[int], list[int], torch.Tensor] | None = None) -> ForwardBatch:
        """The step's batch; ``eager``: never a captured graph (a step with image inputs, which graphs do not read).
        ``pending`` = (rows, src, tokens): rows ``rows`` of the input ids become ``tokens[src]`` on the device (a
        step overlapped with the previous one takes that step's samples; -1, a row whose logits were not finite,
        reads token 0: that sequence ends with an error when the host sees it). Their indices go over with the
        step's other inputs."""
        bs = cache.block_size
        handles = [cache.handle(s.seq.seq_id) for s in scheduled]
        width = max((len(h.blocks) for h in handles), default=0) or 1
        rows = len(scheduled)
        graphs = key = None
        if not eager and all(s.num_tokens == 1 for s in scheduled):
            graphs = self.graphs
            key = graphs.lookup(rows, width) if graphs is not None else None
            if key is not None:
                rows, width = key  # padded to the captured size and block-table width
        elif not eager and self.prefill_graphs is not None:
            graphs = self.prefill_graphs
            key = graphs.lookup(sum(s.num_tokens for s in scheduled), rows, width)
            if key is not None:
                rows, width = key[1:]  # then rows sequences, the padding one and the empty ones included
        last = max((s.seq.num_computed + s.num_tokens for s in scheduled), default=0)
        if self.max_positions is not None and last > self.max_positions:
            # a device gather past a table would stop the whole process; the engine's admission never lets it come
            raise RuntimeError(f"a step reaches position {last - 1}, past the {self.max_positions} positions the "
                               "engine was built for")
        G = self.groups
        if any(len(h.tables) != G for h in handles):
            raise RuntimeError(f"the cache manager keeps {len(handles[0].tables)} block tables a sequence, the runner's "
                               f"cache {G}: build both from one plan")
        ids, pos, starts, lens, state_slots, fresh, sample_rows = [], [], [], [], [], [], []
        slots, tables = [[] for _ in range(G)], [[] for _ in range(G)]  # per block group
        rope = [] if self.mrope else None  # 1-D multimodal RoPE positions: index + the sequence's rope delta
        query_start = [0]
        for s, h in zip(scheduled, handles):
            seq, n = s.seq, s.num_tokens
            a, b = seq.num_computed, seq.num_computed + n
            ids += seq.token_ids[a:b]
            pos += range(a, b)
            if rope is not None:
                d = seq.images.rope_delta if seq.images is not None else 0
                rope += range(a + d, b + d)
            for g, table in enumerate(h.tables):
                slots[g] += [table[p // bs] * bs + p % bs for p in range(a, b)] if table else [NULL_BLOCK] * n
                tables[g].append(table)
            starts.append(a)
            lens.append(b)
            state_slots.append(h.slot if h.slot is not None else NULL_SLOT)
            fresh.append(a == 0)
            query_start.append(query_start[-1] + n)
            if s.samples:
                sample_rows.append(query_start[-1] - 1)
        # padding: in a decode graph, sequences of one fresh token at position 0 in the null block and slot; in a
        # prefill graph, one such sequence holds every row up to the capture's row count and the rest have none
        pad = [1] * (rows - len(scheduled))
        if key is not None and graphs is self.prefill_graphs:
            pad = [key[0] - len(ids)] + [0] * (rows - len(scheduled) - 1)
        for n in pad:
            ids += [0] * n
            pos += [0] * n
            for g in range(G):
                slots[g] += [NULL_BLOCK * bs] * n
            if rope is not None:
                rope += [0] * n
            starts.append(0), lens.append(min(n, 1))
            state_slots.append(NULL_SLOT), fresh.append(True), query_start.append(query_start[-1] + n)
        buf = self._buffers_for(len(ids), rows, width)
        buf.begin()
        batch = ForwardBatch(
            buf.put("input_ids", ids), buf.put("positions", pos), query_start, starts, lens,
            buf.put("slot_mapping", slots[0]), buf.put_table(tables[0], rows, width), buf.put("state_slots", state_slots),
            buf.put("logits_indices", sample_rows), bs, cu_seqlens=buf.put("cu_seqlens", query_start),
            fresh=buf.put("fresh", fresh), topk_buffer=buf.topk[: len(ids)], num_real=len(scheduled),
            window_group=self._window_group(buf, slots[-1], tables[-1], rows, width),
        )
        if rope is not None:
            batch.rope_positions = buf.put("rope_positions", rope)
        if sample_rows == list(range(len(sample_rows))):
            batch.leading_samples = len(sample_rows)
        patch = None
        if pending is not None and pending[0]:
            patch = batch.input_ids, buf.put("patch_rows", pending[0]), buf.put("patch_src", pending[1]), pending[2]
        buf.end(patch)
        batch.graph, batch.graph_set = key, graphs if key is not None else None
        return batch

    def _window_group(self, buf: StepBuffers, slots: list[int], tables: list[list[int]], rows: int,
                      width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The windowed layers' (slot mapping, block tables) in their step buffers, when they have a pool of their
        own (the step's second block group)."""
        if self.groups < 2:
            return None
        return buf.put("slot_mapping1", slots), buf.put_table(tables, rows, width, "block_tables1")

    def padding_batch(self, rows: int, width: int, block_size: int) -> ForwardBatch:
        """A decode step of ``rows`` padding rows over ``width`` table columns, written into the step buffers:
        what a graph is captured with. Its plan has no host lengths (a captured step must not read them)."""
        buf = self._buffers_for(rows, rows, width)
        buf.begin()
        batch = ForwardBatch(
            buf.put("input_ids", [0] * rows), buf.put("positions", [0] * rows), list(range(rows + 1)), None, None,
            buf.put("slot_mapping", [NULL_BLOCK] * rows), buf.put_table([], rows, width),
            buf.put("state_slots", [NULL_SLOT] * rows), buf.put("logits_indices", list(range(rows))), block_size,
            cu_seqlens=buf.put("cu_seqlens", list(range(rows + 1))), fresh=buf.put("fresh", [True] * rows),
            topk_buffer=buf.topk[:rows],
            window_group=self._window_group(buf, [NULL_BLOCK] * rows, [], rows, width),
        )
        if self.mrope:  # the graph reads the 1-D multimodal RoPE positions from their buffer
            batch.rope_positions = buf.put("rope_positions", [0] * rows)
        buf.end()
        return batch

    def prefill_padding_batch(self, tokens: int, seqs: int, width: int, block_size: int) -> ForwardBatch:
        """A prefill step of ``tokens`` rows in ``seqs`` sequences over ``width`` table columns, written into the
        step buffers: what a prefill graph is captured with. Every row is the first sequence's (position 0, the
        null block and slot), the others have none. Its plan has no host lengths."""
        buf = self._buffers_for(tokens, seqs, width)
        buf.begin()
        query_start = [0] + [tokens] * seqs
        batch = ForwardBatch(
            buf.put("input_ids", [0] * tokens), buf.put("positions", [0] * tokens), query_start, None, None,
            buf.put("slot_mapping", [NULL_BLOCK] * tokens), buf.put_table([], seqs, width),
            buf.put("state_slots", [NULL_SLOT] * seqs), buf.put("logits_indices", []), block_size,
            cu_seqlens=buf.put("cu_seqlens", query_start), fresh=buf.put("fresh", [True] * seqs),
            topk_buffer=buf.topk[:tokens],
            window_group=self._window_group(buf, [NULL_BLOCK] * tokens, [], seqs, width),
        )
        if self.mrope:
            batch.rope_positions = buf.put("rope_positions", [0] * tokens)
        buf.end()
        return batch

    def before_step(self) -> None:
        """Packed-expert workspaces forget what they hold: a replayed graph may have overwritten them."""
        if self._workspaces is None:
            found = {id(m.workspace): m.workspace for m in self.model.modules() if getattr(m, "workspace", None) is not None}
            self._workspaces = [ws for ws in found.values() if hasattr(ws, "invalidate")]
        for ws in self._workspaces:
            ws.invalidate()

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [S, vocab] fp32 for the rows in ``batch.logits_indices``."""
        self.before_step()
        if self.host_copies is not None:  # blocks on their way to or from host memory
            self.host_copies.before_step()
        self.step_counts["decode" if batch.is_decode else "prefill", "eager" if batch.graph is None else "graph"] += 1
        hidden = batch.graph_set.replay(batch.graph) if batch.graph is not None else self.model(batch)
        n = batch.leading_samples
        return self.model.compute_logits(hidden[:n] if n is not None else hidden[batch.logits_indices])
