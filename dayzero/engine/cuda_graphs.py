"""Decode steps as CUDA graphs: the model body captured once per (batch size, block-table width), replayed.

A decode step is hundreds of small kernels; launched one by one from Python the GPU waits on the host most
of the time. Captured, a step is one replay. What a graph reads are the runner's persistent step buffers
(token ids, positions, slot mapping, state slots, block tables, ...), so a replay only needs the new step
written there first. A step of B sequences is padded to the next captured size with rows that read and write
only the null block and the null state slot, and its block tables to the next captured width: the keys a
decode op gathers are a fixed [B, width · block_size] tile, so the width is part of the shape. Graphs are
captured largest first into one shared memory pool, so together they cost about what the largest costs.

Before each capture the padded step runs once eagerly under ``torch.cuda.set_sync_debug_mode("error")``: an
op that would wait on the host (``.item()``, a pageable copy, a data-dependent shape) stops the capture with
its own error, and the engine then decodes eagerly and says why. Prefill and mixed steps always run eagerly.
"""
from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager

import torch

log = logging.getLogger("dayzero")


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


def default_widths(max_blocks: int, block_size: int, max_len: int, min_tokens: int = 256) -> list[int]:
    """Block-table widths to capture: powers of two from ``min_tokens`` worth of blocks, up to the widest
    table ``max_len`` tokens need (capped at ``max_blocks``)."""
    cap = min(max_blocks, -(-max_len // block_size))
    w, out = max(1, min_tokens // block_size), []
    while w < cap:
        out.append(w)
        w *= 2
    return out + [cap]


@contextmanager
def sync_debug(mode: str):
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


@torch.inference_mode()
def measure_step_bytes(runner, size: int, width: int, block_size: int) -> int:
    """Peak memory one eager decode step of ``size`` rows over ``width`` table columns allocates beyond what is
    already held: about what the graphs' shared pool will keep. Runs before the cache exists, on a stand-in
    cache of a few blocks and one slot (padding rows read only the null block and slot)."""
    from dayzero.cache.planner import plan_cache

    dev = runner.device
    runner.allocate_cache(plan_cache(runner.specs, block_size, block_size, 1, None, 2))
    runner.reserve_buffers(size, size, width)
    batch = runner.padding_batch(size, width, block_size)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    runner.before_step()
    runner.model(batch)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    for _, layer in runner.layers:  # the stand-in cache goes; the planned one replaces it
        layer.bind_cache(None)
    runner.buffers = None
    torch.cuda.empty_cache()
    return int(peak * 1.25) + (64 << 20)  # allocator rounding and per-graph bookkeeping


class DecodeGraphs:
    def __init__(self, runner, sizes: list[int], widths: list[int], block_size: int):
        self.runner, self.block_size = runner, block_size
        self.sizes, self.widths = sorted(set(sizes)), sorted(set(widths))
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.nbytes = 0
        self.seconds = 0.0
        self.replays = 0

    def lookup(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The captured (size, width) a decode step of ``num_seqs`` sequences and ``width`` table columns
        replays, or None when it is larger than every capture (it then runs eagerly)."""
        size = next((s for s in self.sizes if s >= num_seqs), None)
        w = next((c for c in self.widths if c >= width), None)
        return None if size is None or w is None else (size, w)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        # cached blocks, and the pools of graphs already destroyed, released first: what the capture reserves is
        # then new segments, so the difference is what these graphs hold
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        self.pool = torch.cuda.graph_pool_handle()
        model = self.runner.model
        for width in reversed(self.widths):
            for size in reversed(self.sizes):
                batch = self.runner.padding_batch(size, width, self.block_size)
                self.runner.before_step()
                with sync_debug("error"):  # an op that waits on the host fails here, by name
                    model(batch)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                self.runner.before_step()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = model(batch)
                self.graphs[(size, width)] = (graph, out)
        torch.cuda.synchronize(dev)
        self.nbytes = torch.cuda.memory_reserved(dev) - before
        self.seconds = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch sizes %s, block-table widths %s) in %.1fs, %.0f MiB",
                 len(self.graphs), self.sizes, self.widths, self.seconds, self.nbytes / 2**20)

    def replay(self, key: tuple[int, int]) -> torch.Tensor:
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out
