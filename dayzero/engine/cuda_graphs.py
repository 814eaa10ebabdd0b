"""Steps as CUDA graphs: the model body captured once per step shape, replayed. Decode steps are captured per
(batch size, block-table width); prefill and mixed steps per (rows, sequences, width) (:class:`PrefillGraphs`).

A decode step is hundreds of small kernels; launched one by one from Python the GPU waits on the host most
of the time. Captured, a step is one replay. What a graph reads are the runner's persistent step buffers
(token ids, positions, slot mapping, state slots, block tables, ...), so a replay only needs the new step
written there first. A step of B sequences is padded to the next captured size with rows that read and write
only the null block and the null state slot, and its block tables to the next captured width: the keys a
decode op gathers are a fixed [B, width · block_size] tile, so the width is part of the shape. Graphs are
captured largest first into one shared memory pool, so together they cost about what the largest costs.

Before each capture the padded step runs once eagerly under ``torch.cuda.set_sync_debug_mode("error")``: an
op that would wait on the host (``.item()``, a pageable copy, a data-dependent shape) stops the capture with
its own error, and the engine then runs those steps eagerly and says why. Steps larger than every capture, and
steps with image inputs, run eagerly.
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
def measure_step_bytes(runner, size: int, width: int, block_size: int,
                       prefill: tuple[int, int, int] | None = None) -> int:
    """Peak memory one eager decode step of ``size`` rows over ``width`` table columns (and, given ``prefill``
    = (rows, sequences, width), one such prefill step) allocates beyond what is already held: about what the
    graphs' shared pool will keep. Runs before the cache exists, on a stand-in cache of a few blocks and one slot
    (padding rows read only the null block and slot)."""
    from dayzero.cache.planner import plan_cache

    dev = runner.device
    runner.allocate_cache(plan_cache(runner.specs, block_size, block_size, 1, None, 2))
    tokens, seqs, widest = (size, size, width) if prefill is None else (max(size, prefill[0]), max(size, prefill[1]),
                                                                       max(width, prefill[2]))
    runner.reserve_buffers(tokens, seqs, widest)
    steps = [lambda: runner.padding_batch(size, width, block_size)]
    if prefill is not None:
        steps.append(lambda: runner.prefill_padding_batch(*prefill, block_size))
    peak = 0
    try:
        for make in steps:
            batch = make()
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
            runner.before_step()
            runner.model(batch)
            torch.cuda.synchronize(dev)
            peak = max(peak, torch.cuda.max_memory_allocated(dev) - base)
    finally:
        for _, layer in runner.layers:  # the stand-in cache goes; the planned one replaces it
            layer.bind_cache(None)
        runner.buffers = None
        torch.cuda.empty_cache()
    return int(peak * 1.25) + (64 << 20)  # allocator rounding and per-graph bookkeeping


class _StepGraphs:
    """Captured steps keyed by their shape, replayed by key; subclasses say which shapes and how a padded step of
    each is laid out. One memory pool may be shared with another set (``pool``), captured after it."""

    kind = "step"

    def __init__(self, runner, block_size: int):
        self.runner, self.block_size = runner, block_size
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.nbytes = 0
        self.seconds = 0.0
        self.replays = 0

    def keys(self) -> list[tuple]:
        """The shapes to capture, largest first (later captures reuse what earlier ones freed in the pool)."""
        raise NotImplementedError

    def padding_batch(self, key: tuple):
        raise NotImplementedError

    def output(self, key: tuple, hidden: torch.Tensor) -> torch.Tensor:
        """What a replay of ``key`` returns, given the captured pass's hidden states (called inside the capture)."""
        return hidden

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        t0 = time.perf_counter()
        dev = self.runner.device
        torch.cuda.synchronize(dev)
        # cached blocks, and the pools of graphs already destroyed, released first: what the capture reserves is
        # then new segments, so the difference is what these graphs hold
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(dev)
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        model = self.runner.model
        for key in self.keys():
            batch = self.padding_batch(key)
            self.runner.before_step()
            with sync_debug("error"):  # an op that waits on the host fails here, by name
                model(batch)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            self.runner.before_step()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.output(key, model(batch))
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize(dev)
        self.nbytes = torch.cuda.memory_reserved(dev) - before
        self.seconds = time.perf_counter() - t0
        log.info("captured %d %s graphs (%s) in %.1fs, %.0f MiB", len(self.graphs), self.kind, self.describe(),
                 self.seconds, self.nbytes / 2**20)

    def describe(self) -> str:
        return ""

    def note(self) -> str:
        """How the steps these graphs cover run, once captured."""
        raise NotImplementedError

    def replay(self, key: tuple) -> torch.Tensor:
        graph, out = self.graphs[key]
        graph.replay()
        self.replays += 1
        return out


class DecodeGraphs(_StepGraphs):
    kind = "decode"

    def __init__(self, runner, sizes: list[int], widths: list[int], block_size: int):
        super().__init__(runner, block_size)
        self.sizes, self.widths = sorted(set(sizes)), sorted(set(widths))

    def lookup(self, num_seqs: int, width: int) -> tuple[int, int] | None:
        """The captured (size, width) a decode step of ``num_seqs`` sequences and ``width`` table columns
        replays, or None when it is larger than every capture (it then runs eagerly)."""
        size = next((s for s in self.sizes if s >= num_seqs), None)
        w = next((c for c in self.widths if c >= width), None)
        return None if size is None or w is None else (size, w)

    def keys(self) -> list[tuple[int, int]]:
        return [(size, width) for width in reversed(self.widths) for size in reversed(self.sizes)]

    def padding_batch(self, key: tuple[int, int]):
        size, width = key
        return self.runner.padding_batch(size, width, self.block_size)

    def describe(self) -> str:
        return f"batch sizes {self.sizes}, block-table widths {self.widths}"

    def note(self) -> str:
        return (f"CUDA graphs for batch sizes {self.sizes[0]}..{self.sizes[-1]} ({len(self.sizes)}) and contexts up "
                f"to {self.widths[-1] * self.block_size} tokens, {self.nbytes / 2**20:.0f} MiB")


def prefill_token_buckets(max_tokens: int, min_tokens: int = 32) -> list[int]:
    """Row counts of the captured prefill steps: powers of two from ``min_tokens`` up to ``max_tokens`` (the last
    bucket itself); none when ``max_tokens`` is 0."""
    if max_tokens < 1:
        return []
    t, out = min_tokens, []
    while t < max_tokens:
        out.append(t)
        t *= 2
    return out + [max_tokens]


def prefill_seats(max_num_seqs: int) -> list[int]:
    """Sequences a captured prefill step holds: one real sequence, or every seat, each with one more for the
    padding rows."""
    return sorted({2, max_num_seqs + 1})


class PrefillGraphs(_StepGraphs):
    """Prefill and mixed steps (any step with a sequence of more than one row) as CUDA graphs, keyed by (rows,
    sequences, block-table width). Eager, such a step costs the host's launch of every kernel of every layer
    (~65 ms for dayzero-small whatever its length up to ~2K tokens, with the GPU busy a few percent of it);
    replayed, it costs its kernels.

    A step of T rows in B sequences replays the smallest capture of at least T rows, B + 1 sequences and its
    table width: its rows first, then one padding sequence holding the rows up to the bucket (position 0, the
    null block and the null state slot, starting fresh), then sequences with no rows up to the capture's count
    (the null slot too). Every op then sees a fixed shape: the row count, the sequence count (``cu_seqlens`` has
    one entry more) and the table width. Ops read only the step buffers; the one that needs its lengths on the
    host eagerly (fla's chunk list for KDA) builds it on the device in a captured step. The hidden states of the
    rows land in one output buffer shared by every prefill graph."""

    kind = "prefill"

    def __init__(self, runner, tokens: list[int], seats: list[int], widths: list[int], block_size: int):
        super().__init__(runner, block_size)
        self.tokens, self.seats, self.widths = sorted(set(tokens)), sorted(set(seats)), sorted(set(widths))
        self.out: torch.Tensor | None = None
        self._order = sorted(self.keys())  # smallest first, for lookup

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (rows, sequences, width) that a step can need: a width is captured for a row bucket when a
        sequence of more rows than the bucket below it fits in it (the widest width always)."""
        keys = []
        for i, t in enumerate(self.tokens):
            below = self.tokens[i - 1] if i else 0
            for w in self.widths:
                if w * self.block_size > below or w == self.widths[-1]:
                    keys += [(t, s, w) for s in self.seats]
        return sorted(keys, reverse=True)

    def lookup(self, num_tokens: int, num_seqs: int, width: int) -> tuple[int, int, int] | None:
        """The smallest captured (rows, sequences, width) a step of ``num_tokens`` rows in ``num_seqs`` sequences
        over ``width`` table columns fits in (one sequence more for its padding rows), or None (it runs eagerly)."""
        return next((k for k in self._order if k[0] >= num_tokens and k[1] > num_seqs and k[2] >= width), None)

    def padding_batch(self, key: tuple[int, int, int]):
        tokens, seats, width = key
        return self.runner.prefill_padding_batch(tokens, seats, width, self.block_size)

    def output(self, key: tuple[int, int, int], hidden: torch.Tensor) -> torch.Tensor:
        if self.out is None:  # the first (largest) capture: allocated by the capture, kept by the pool
            self.out = torch.empty((self.tokens[-1], *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device)
        view = self.out[: hidden.shape[0]]
        view.copy_(hidden)
        return view

    def describe(self) -> str:
        return f"rows {self.tokens}, sequences {self.seats}, block-table widths {self.widths}"

    def note(self) -> str:
        return (f"CUDA graphs for steps of up to {self.tokens[-1]} rows in 1 or up to {self.seats[-1] - 1} sequences "
                f"({len(self.graphs)} graphs, {self.seconds:.1f} s)")
