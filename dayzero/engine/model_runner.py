"""The model runner: owns the model and its cache tensors, turns a schedule into a flat batch, runs the
forward pass and returns the logits of the sequences to sample."""
from __future__ import annotations

import torch

from dayzero.cache.manager import CacheManager
from dayzero.cache.planner import CachePlan
from dayzero.cache.spec import PagedSpec, allocate, parts
from dayzero.engine.batch import ForwardBatch
from dayzero.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model, device: torch.device, cache_dtype: torch.dtype, kv_cache_dtype: str = "auto"):
        self.model = model
        self.device = device
        self.cache_dtype = cache_dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.layers = model.cached_layers()
        self.layer_specs = [parts(layer.cache_spec(cache_dtype)) for _, layer in self.layers]
        self.specs = [s for specs in self.layer_specs for s in specs]  # every spec, for planning

    def allocate_cache(self, plan: CachePlan) -> None:
        for (_, layer), specs in zip(self.layers, self.layer_specs):
            tensors = {}
            for spec in specs:
                count = plan.num_blocks if isinstance(spec, PagedSpec) else plan.num_slots
                tensors.update(allocate(spec, count, plan.block_size, self.device, self.kv_cache_dtype))
            layer.bind_cache(tensors)

    def build_batch(self, scheduled: list[ScheduledSeq], cache: CacheManager) -> ForwardBatch:
        bs = cache.block_size
        ids, pos, slots, starts, lens, tables, state_slots, sample_rows = [], [], [], [], [], [], [], []
        query_start = [0]
        for s in scheduled:
            seq, n = s.seq, s.num_tokens
            a, b = seq.num_computed, seq.num_computed + n
            h = cache.handle(seq.seq_id)
            ids += seq.token_ids[a:b]
            pos += range(a, b)
            if h.blocks:
                slots += [h.blocks[p // bs] * bs + p % bs for p in range(a, b)]
            else:
                slots += [0] * n
            starts.append(a)
            lens.append(b)
            tables.append(h.blocks)
            state_slots.append(h.slot if h.slot is not None else 0)
            query_start.append(query_start[-1] + n)
            if s.samples:
                sample_rows.append(query_start[-1] - 1)
        width = max((len(t) for t in tables), default=0) or 1
        table = torch.zeros((len(tables), width), dtype=torch.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = torch.tensor(t, dtype=torch.int64)
        dev = self.device
        as_t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        return ForwardBatch(
            input_ids=as_t(ids), positions=as_t(pos), query_start=query_start, seq_start=starts, seq_lens=lens,
            slot_mapping=as_t(slots), block_tables=table.to(dev), state_slots=as_t(state_slots),
            logits_indices=as_t(sample_rows), block_size=bs,
        )

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [S, vocab] fp32 for the rows in ``batch.logits_indices``."""
        hidden = self.model(batch)
        return self.model.compute_logits(hidden[batch.logits_indices])
