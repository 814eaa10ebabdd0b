"""One place that turns a built model into something that runs: weights prepared for the forward pass, the
cache planned and allocated, the model runner with its step buffers, the cache manager, and the decode CUDA
graphs. The engine, ``dayzero profile``, the op probe and ``align`` all assemble through here."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

import torch

from dayzero.cache.host_tier import HostCopies
from dayzero.cache.manager import CacheManager
from dayzero.cache.planner import (SPARE_SNAPSHOTS_PER_SEAT, CacheMemoryError, CachePlan, auto_block_size,
                                   available_memory, block_groups, plan_cache)
from dayzero.cache.spec import PagedSpec, StateSpec
from dayzero.engine.model_runner import ModelRunner
from dayzero.layers.rotary import reserve_tables
from dayzero.ops import choices
from dayzero.ops.indexer.triton_indexer import scratch_bytes as indexer_scratch_bytes

log = logging.getLogger("dayzero")


@dataclass
class Assembled:
    runner: ModelRunner
    cache: CacheManager
    plan: CachePlan
    graph_note: str  # how decode steps run: "CUDA graphs ..." or "eager (why)"
    prefill_note: str = "eager"  # how prefill and mixed steps run, the same way


def prepare_weights(model: torch.nn.Module) -> None:
    """Once after the weights load (or change): every module derives what its forward pass needs, so nothing
    is re-derived per step (e.g. block-FP8 weights an op reads dense, hash-routing tables checked)."""
    for m in model.modules():
        fn = getattr(m, "process_weights_after_loading", None)
        if fn is not None:
            fn()


def prefill_scratch_bytes(model, rows: int, keys: int) -> int:
    """Transient bytes a prefill step of ``rows`` query rows over ``keys`` keys holds beside the cache, at its
    largest layer: the DSA indexer's scores, which its varlen form keeps under a budget
    (``triton_indexer.scratch_bytes``), and absorbed MLA's fp32 query and latent output ([rows, H, R+P] and
    [rows, H, R]), which the device path of prefill rows holds while it attends."""
    topks = {m.selection_width for m in model.modules() if getattr(m, "selection_width", 0)}
    indexer = max((indexer_scratch_bytes(rows, keys, k) for k in topks), default=0)
    mla = max((rows * m.H * (2 * m.R + m.P) * 4 for m in model.modules() if hasattr(m, "kv_b_weight")), default=0)
    return indexer + mla


HOST_TIER_MAX_SHARE = 0.8  # of the host's available memory, the most the host tier may pin (the rest: the process)


def attach_host_tier(runner, cache: CacheManager, plan: CachePlan, host_bytes: int) -> CachePlan:
    """Give the prefix cache a host tier of ``host_bytes`` pinned bytes: half for state snapshots when the model
    keeps states, the rest for blocks; the plan records both counts."""
    free = available_memory(torch.device("cpu"))  # RAM the process may still take
    if host_bytes > free * HOST_TIER_MAX_SHARE:
        raise CacheMemoryError(
            f"host_cache_gib asks for {host_bytes / 2**30:.2f} GiB of pinned host memory, but the host has "
            f"{free / 2**30:.2f} GiB available ({HOST_TIER_MAX_SHARE:.0%} of it may be pinned for the prefix cache's "
            f"host tier): lower host_cache_gib (--host-cache-gib) to at most {free * HOST_TIER_MAX_SHARE / 2**30:.2f}")
    # blocks of windowed layers are not kept: a hit needs only a window's tail, which stays on the device
    per_block = HostCopies.bytes_per_row(runner.block_tensors) if plan.window is None else 0
    per_snap = HostCopies.bytes_per_row(runner.state_tensors) if runner.state_tensors else 0
    snaps = host_bytes // 2 // per_snap if per_snap and plan.num_snapshots else 0
    blocks = (host_bytes - snaps * per_snap) // per_block if per_block else 0
    runner.host_copies = HostCopies(runner.block_tensors, runner.state_tensors, blocks, snaps)
    cache.attach_host_tier(runner.host_copies)
    return replace(plan, host_blocks=int(blocks), host_snapshots=int(snaps))


def _agree(agree, plan, uses_blocks: bool, uses_slots: bool, align: int, snapshots: int):
    """One cache plan for every rank of a job: the fewest blocks, slots and snapshots, block and slot accounting
    where any rank needs it, the coarsest alignment. A rank without paged (state) layers does not limit the
    blocks (slots, snapshots)."""
    free = 2**62
    blocks, slots, snaps, no_blocks, no_slots, neg_align, window_blocks = agree([
        plan.num_blocks if uses_blocks and plan.bytes_per_block else free, plan.num_slots if uses_slots else free,
        plan.num_snapshots if uses_slots else free, int(not uses_blocks), int(not uses_slots), -align,
        plan.window_pool[1] if plan.window_pool else free])
    uses_blocks, uses_slots = not no_blocks, not no_slots
    if -neg_align % align:
        raise ValueError(f"the ranks' cache alignments ({align} here, {-neg_align} elsewhere) are not multiples of "
                         "one another")
    plan = replace(plan, num_blocks=plan.num_blocks if blocks == free else blocks,
                   num_slots=plan.num_slots if slots == free else slots,
                   num_snapshots=(snapshots if uses_slots else 0) if snaps == free else snaps)
    if plan.window_pool and window_blocks != free:
        plan = replace(plan, window_pool=(plan.window_pool[0], window_blocks, plan.window_pool[2]))
    return plan, uses_blocks, uses_slots, -neg_align


def assemble(model, device: torch.device, dtype: torch.dtype, *, block_size: int | None, max_model_len: int,
             max_num_seqs: int, max_num_batched_tokens: int, budget_bytes: int | None = None,
             memory_fraction: float = 0.5, num_cache_blocks: int | None = None, kv_cache_dtype: str = "auto",
             cuda_graphs: bool = False, cuda_graph_sizes: list[int] | None = None,
             cuda_graph_max_len: int = 8192, cuda_graph_prefill_tokens: int = 2048, prefix_caching: bool = False,
             snapshot_interval: int = 512, eviction_policy: str = "adaptive",
             num_snapshots: int | None = None, index_cache_dtype: str = "auto", host_cache_bytes: int = 0,
             extra_scratch_bytes: int = 0, agree=None) -> Assembled:
    """Plan and allocate the cache, build the runner and cache manager, and (``cuda_graphs`` on a CUDA device)
    capture the decode graphs. The model's weights must be loaded and prepared.

    ``block_size`` None takes :func:`~dayzero.cache.planner.auto_block_size`. The cache gets ``budget_bytes``,
    or with neither it nor ``num_cache_blocks`` given, ``memory_fraction`` of the free memory less what the
    decode graphs will hold (measured by one eager decode step of the largest captured shape before the cache is
    allocated) and the prefill scratch (:func:`prefill_scratch_bytes`, plus ``extra_scratch_bytes``: the vision
    encoder's); the plan records both. With
    ``prefix_caching``, models that keep per-sequence states get ``num_snapshots`` state snapshots (default one
    per sequence seat, and up to :data:`~dayzero.cache.planner.SPARE_SNAPSHOTS_PER_SEAT` more a seat from
    budget the capped blocks leave) taken every ``snapshot_interval`` tokens, cached blocks and snapshots evicted
    by ``eviction_policy`` (:mod:`dayzero.cache.eviction`), and ``host_cache_bytes`` of pinned host memory
    keep what the device evicts (:func:`attach_host_tier`).

    ``agree(values)``, given to each rank of a multi-process engine, returns each value's smallest over the
    ranks: every rank then plans for the smallest budget and keeps the same numbers of blocks, slots and snapshots
    and the same cache rules (a pipeline stage without paged or state layers still hands out blocks and slots
    as the others do), because every rank's scheduler must take the same decisions."""
    from dayzero.engine.cuda_graphs import (DecodeGraphs, PrefillGraphs, default_sizes, default_widths,
                                            measure_step_bytes, prefill_seats, prefill_token_buckets)

    runner = ModelRunner(model, device, dtype, kv_cache_dtype, index_cache_dtype)
    reserve_tables(model, max_model_len, device)  # RoPE's cos/sin gathered in one launch a step, not computed in six
    runner.max_positions = max_model_len
    block_size = block_size or auto_block_size(runner.specs)
    max_blocks = -(-max_model_len // block_size)
    graphs_on = cuda_graphs and device.type == "cuda"
    sizes = widths = prefill_failure = None
    graph_bytes = 0
    # prefill graphs: steps of up to this many rows (never more than a step holds)
    prefill_tokens = prefill_token_buckets(min(cuda_graph_prefill_tokens, max_num_batched_tokens)) if graphs_on else []
    if graphs_on:
        sizes = sorted(s for s in (cuda_graph_sizes or default_sizes(max_num_seqs)) if 1 <= s <= max_num_seqs)
        widths = default_widths(max_blocks, block_size, min(max_model_len, cuda_graph_max_len))
        largest = (prefill_tokens[-1], prefill_seats(max_num_seqs)[-1], widths[-1]) if prefill_tokens else None
        try:
            graph_bytes = measure_step_bytes(runner, sizes[-1], widths[-1], block_size, largest)
        except Exception as e:  # noqa: BLE001 - the padded prefill step cannot run as captured: eager prefill
            if largest is None:
                raise
            prefill_tokens, prefill_failure = [], _failure("prefill", e)
            graph_bytes = measure_step_bytes(runner, sizes[-1], widths[-1], block_size)
    scratch = prefill_scratch_bytes(model, max_num_batched_tokens, max_model_len) + extra_scratch_bytes
    if budget_bytes is None and num_cache_blocks is None:
        budget_bytes = int(available_memory(device) * memory_fraction) - graph_bytes - scratch
        if agree is not None:
            budget_bytes = agree([budget_bytes])[0]
    uses_slots = any(isinstance(s, StateSpec) for s in runner.specs)
    snapshots = (max_num_seqs if num_snapshots is None else num_snapshots) if prefix_caching and uses_slots else 0
    # by default up to SPARE_SNAPSHOTS_PER_SEAT more per seat where memory would otherwise go unused: a workload
    # that comes back to more distinct prompts than seats would find each snapshot evicted before its next turn
    spare = SPARE_SNAPSHOTS_PER_SEAT * max_num_seqs if snapshots and num_snapshots is None else 0
    has_full, window = block_groups(runner.specs)
    if agree is not None:  # the whole model's block groups: every rank's scheduler keeps the same tables
        no_full, neg_window = agree([-int(has_full), -(window or 0)])
        has_full, window = bool(-no_full), -neg_window or None
    plan = plan_cache(runner.specs, block_size, max_model_len, max_num_seqs, budget_bytes, num_cache_blocks,
                      kv_cache_dtype, snapshots, index_cache_dtype, spare_snapshots=spare,
                      step_tokens=max_num_batched_tokens, groups=(has_full, window))
    plan = replace(plan, scratch_bytes=scratch)
    # a paged row that stands for m tokens (compressed entries) is complete only at multiples of m
    strides = [m for s in runner.specs if isinstance(s, PagedSpec) for m in s.strides.values()]
    uses_blocks, align = any(isinstance(s, PagedSpec) for s in runner.specs), math.lcm(block_size, *strides)
    if agree is not None:
        plan, uses_blocks, uses_slots, align = _agree(agree, plan, uses_blocks, uses_slots, align,
                                                      max_num_seqs if prefix_caching else 0)
    runner.allocate_cache(plan)
    cache = CacheManager(block_size, plan.num_blocks, plan.num_slots, uses_blocks=uses_blocks, uses_slots=uses_slots,
                         prefix_caching=prefix_caching, snapshot_interval=snapshot_interval,
                         num_snapshots=plan.num_snapshots, align=align, eviction_policy=eviction_policy,
                         window=plan.window, window_pool=plan.window_pool and plan.window_pool[:2])
    if host_cache_bytes and cache.prefix_caching:
        plan = attach_host_tier(runner, cache, plan, host_cache_bytes)
    max_seqs = min(max_num_seqs, plan.num_slots)
    # one sequence more than the seats: a captured prefill step's padding rows are a sequence of their own
    runner.reserve_buffers(max(max_num_batched_tokens, max_seqs), max_seqs + bool(prefill_tokens), max_blocks)
    note, prefill_note = "eager", prefill_failure or "eager"
    if graphs_on and not prefill_tokens and prefill_failure is None:
        prefill_note = "eager (cuda_graph_prefill_tokens=0)"
    if graphs_on:
        sizes = [s for s in sizes if s <= max_seqs] or [max_seqs]
        pool = None
        if prefill_tokens:  # captured first, the larger steps: the decode graphs then reuse their pool
            prefill = PrefillGraphs(runner, prefill_tokens, prefill_seats(max_seqs), widths, block_size)
            prefill_note, ok = _capture(prefill, device)
            if ok:
                runner.prefill_graphs, pool = prefill, prefill.pool
        graphs = DecodeGraphs(runner, sizes, widths, block_size)
        note, ok = _capture(graphs, device, pool)
        if ok:
            runner.graphs = graphs
        held = sum(g.nbytes for g in (runner.graphs, runner.prefill_graphs) if g is not None)
        if (line := choices.summary(device)) is not None:  # the captures' warm-up passes made the choices
            log.info("%s", line)
        plan = replace(plan, graph_bytes=held)
    elif cuda_graphs:
        note = prefill_note = "eager (CUDA graphs need a CUDA device)"
    return Assembled(runner, cache, plan, note, prefill_note)


def _failure(kind: str, e: Exception) -> str:
    note = f"eager ({kind} graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:300]})"
    log.warning("%s steps run eagerly: %s", kind, note)
    return note


def _capture(graphs, device: torch.device, pool=None) -> tuple[str, bool]:
    """Capture a graph set: (how its steps run, whether they replay). A failure leaves the steps eager."""
    try:
        graphs.capture(pool)
    except Exception as e:  # noqa: BLE001 - any failure leaves the engine correct, only slower
        torch.cuda.synchronize(device)
        graphs.graphs.clear()
        return _failure(graphs.kind, e), False
    return graphs.note(), True
