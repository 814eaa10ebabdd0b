"""Hand-made steps over paged pools for the batch-wide op tests: sequences with some tokens already cached and
some new, distinct random blocks (so a block-table mix-up reads another sequence's rows), and pools whose rows
that no sequence owns hold NaN (so an op that reads a row it must not, even with weight 0, fails)."""
from __future__ import annotations

import math

import torch

from dayzero.engine.batch import ForwardBatch


def make_batch(starts: list[int], news: list[int], bs: int, seed: int = 0, num_slots: int = 16,
               pad_rows: int = 0) -> ForwardBatch:
    """Sequence b has ``starts[b]`` tokens cached and brings ``news[b]``; ``pad_rows`` padding rows as a captured
    decode step has (one fresh token at position 0 in the null block and the null slot)."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in zip(starts, news)]
    need = [math.ceil(n / bs) for n in lens]
    ids = (torch.randperm(sum(need) + 3, generator=g) + 1).tolist()
    tables, at = [], 0
    for k in need:
        tables.append(ids[at:at + k])
        at += k
    tables += [[] for _ in range(pad_rows)]
    starts, news, lens = starts + [0] * pad_rows, news + [1] * pad_rows, lens + [1] * pad_rows
    width = max(max(need), 1)
    table = torch.zeros(len(tables), width, dtype=torch.int64)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.int64)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news)])
    query_start = [0]
    for n in news:
        query_start.append(query_start[-1] + n)
    slots = torch.cat([table[b, torch.arange(s, s + n) // bs] * bs + torch.arange(s, s + n) % bs
                       for b, (s, n) in enumerate(zip(starts, news))])
    real = len(lens) - pad_rows
    state = (torch.randperm(num_slots, generator=g)[:real] + 1).tolist() + [0] * pad_rows
    return ForwardBatch(torch.zeros(len(pos), dtype=torch.int64), pos, query_start, starts, lens, slots, table,
                        torch.tensor(state), torch.tensor(query_start[1:]) - 1, bs)


def on_device(b: ForwardBatch, dev: str | torch.device) -> ForwardBatch:
    """The same step with its tensors on ``dev`` (cu_seqlens and fresh rebuilt there from the host plan)."""
    p = b.plan
    return ForwardBatch(b.input_ids.to(dev), b.positions.to(dev), p.query_start, p.seq_start, p.seq_lens,
                        b.slot_mapping.to(dev), b.block_tables.to(dev), b.state_slots.to(dev),
                        b.logits_indices.to(dev), b.block_size)


def capture(fn):
    """(a CUDA graph of ``fn()``, its output): ``fn`` runs once on a side stream first, so that every Triton kernel
    compiles outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def make_pool(batch: ForwardBatch, row: tuple[int, ...], num_blocks: int, seed: int = 0,
              stride: int = 1, dtype=torch.float32) -> torch.Tensor:
    """A paged pool [num_blocks, ceil(bs / stride), *row]: random rows where a sequence of ``batch`` keeps a
    token (stride 1) or a complete entry (one per ``stride`` tokens), NaN everywhere else."""
    g = torch.Generator().manual_seed(seed)
    bs = batch.block_size
    pool = torch.full((num_blocks, -(-bs // stride), *row), float("nan"), dtype=dtype)
    flat = pool.view(-1, *row)
    for b, n in enumerate(batch.seq_lens):
        count = n if stride == 1 else n // stride
        if count:
            slots = batch.entry_slots(b, stride, torch.arange(count))
            flat[slots] = torch.randn(count, *row, generator=g).to(dtype)
    return pool


def num_blocks_of(batch: ForwardBatch) -> int:
    return int(batch.block_tables.max()) + 2
