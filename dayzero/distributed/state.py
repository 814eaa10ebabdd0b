"""The parallel layout of one process and its collectives.

One process per device. The job's ``world`` ranks hold the same sequences, unless attention is data parallel
(``dp > 1``): then each of a stage's ``dp`` tp groups, with the ranks of the same positions in the other stages (a
replica), holds sequences of its own, and only the routed experts' exchange crosses replicas. Pipeline parallelism
cuts the layers into ``pp`` contiguous stages of ``G = world / pp`` consecutive ranks each; the ranks of one
in-stage position form a pp group (hidden states go from each rank to the same position of the next stage, and the
last stage's logits are broadcast back). Inside a stage, attention, dense MLPs and shared experts are split over tp
groups of ``tp`` consecutive ranks (with ``G / tp`` replicas of each split); routed experts are spread over the
``ep`` ranks of an expert group: the whole stage (``ep = G``), none (``ep = 1``: each expert's width is split over
tp instead), or in between, where the stage holds ``G / ep`` expert groups (every ``G / ep``-th rank) and each
expert's width is split over the ``G / ep`` consecutive ranks of an expert-TP group, one rank of each expert group.
A :class:`ParallelState` is a plain frozen value: the layers keep the one they were built with, and a collective
reads its group from it, never from a global. In one process the collectives return their input before anything
of ``torch.distributed`` is touched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("gloo", "nccl")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ParallelState:
    """``tp_rank`` of ``tp_size`` ranks in ``tp_group``, ``ep_rank`` of ``ep_size`` in ``ep_group`` and pipeline
    stage ``pp_rank`` of ``pp_size`` (``torch.distributed`` process groups; None at size 1, or for a layout built
    only to be checked or planned on the meta device, which must run no collective)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None
    backend: str | None = None
    device: torch.device | None = None  # the rank's device (cuda:LOCAL_RANK under NCCL), None: the caller's choice
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: object = None
    world_rank: int = 0  # this process's rank in the job
    world_size: int = 1
    redundant_experts: int = 0  # extra expert slots per MoE layer over the ep ranks, for copies of hot experts
    pp_rank: int = 0  # this rank's pipeline stage
    pp_size: int = 1
    pp_group: object = None  # the ranks of this in-stage position, one per stage
    # with 1 < ep < a stage's G ranks: each expert's width is split over the G / ep ranks of an expert-TP group
    # (consecutive ranks, one per expert group); see etp_size
    ep_tp_rank: int = 0
    ep_tp_size: int = 1
    ep_tp_group: object = None
    # attention data parallelism: this rank's replica (its tp group) of dp_size in the stage, each with its own
    # sequences; the routed experts' tokens are shared out over the tp group instead of the expert group
    dp_rank: int = 0
    dp_size: int = 1

    def __post_init__(self):
        for name in ("tp", "ep", "pp", "ep_tp", "dp"):
            size, rank = getattr(self, f"{name}_size"), getattr(self, f"{name}_rank")
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive int, got {size!r}")
            if not 0 <= rank < size:
                raise ValueError(f"{name} rank {rank} is outside [0, {name}={size})")
        R = self.redundant_experts
        if isinstance(R, bool) or not isinstance(R, int) or R < 0:
            raise ValueError(f"num_redundant_experts must be an int >= 0, got {R!r}")
        if R and (self.ep_size == 1 or R % self.ep_size):
            raise ValueError(f"num_redundant_experts={R} needs expert parallelism and a multiple of ep={self.ep_size} "
                             "(each rank gets the same number of extra slots)")

    @property
    def etp_size(self) -> int:
        """Ranks each routed expert's intermediate width is split over: tp without expert parallelism (expert TP),
        1 when ep spans the stage, ``G / ep`` in between."""
        return self.tp_size if self.ep_size == 1 else self.ep_tp_size

    @property
    def etp_rank(self) -> int:
        return self.tp_rank if self.ep_size == 1 else self.ep_tp_rank

    @property
    def etp_group(self):
        return self.tp_group if self.ep_size == 1 else self.ep_tp_group

    @property
    def meets_other_replicas(self) -> bool:
        """Whether this rank's replica shares a collective with the others (attention data parallelism with the
        routed experts spread over ranks): then every replica must run each MoE layer's exchange every step."""
        return self.dp_size > 1 and self.ep_size > 1

    def replica_of(self, rank: int) -> int:
        """The attention data-parallel replica of ``rank`` in this job (0 for every rank without it)."""
        return replica_of(rank, self.tp_size, self.dp_size, self.world_size // self.pp_size)

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def replica_of(rank: int, tp: int, dp: int, stage: int) -> int:
    """The replica of ``rank`` (its tp group's position in its stage of ``stage`` ranks) under ``dp > 1``, else 0."""
    return rank % stage // tp if dp > 1 else 0


def pipeline_stages(num_layers: int, pp: int) -> list[range]:
    """The decoder layers of each stage: ``num_layers`` cut into ``pp`` contiguous runs whose lengths differ by at
    most one (the first stages take the longer runs)."""
    if num_layers < pp:
        raise ValueError(f"pp={pp} exceeds num_hidden_layers={num_layers}: every stage needs a layer")
    per, extra = divmod(num_layers, pp)
    starts = [s * per + min(s, extra) for s in range(pp + 1)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


SINGLE = ParallelState()
_current = SINGLE


def current() -> ParallelState:
    """The state :func:`init_parallel` set up in this process (:data:`SINGLE` before, or after
    :func:`destroy_parallel`)."""
    return _current


def divide(n: int, state: ParallelState, what: str, over: str = "tp") -> int:
    """``n // tp`` (or ``// ep`` with ``over="ep"``), or the ``ValueError`` naming the setting when it does not
    divide."""
    size = getattr(state, f"{over}_size")
    if n % size:
        raise ValueError(f"{over}={size} does not divide {what}={n}")
    return n // size


# --- collectives ----------------------------------------------------------------------------------------
def tp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of ``x`` over the tp group (in place; every rank gets it). Identity at tp=1."""
    if state.tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=state.tp_group)
    return x


def etp_all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The sum of ``x`` over the ranks that split each expert's width (in place). Identity when they are one."""
    if state.etp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, group=state.etp_group)
    return x


def _all_gather(x: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    """Every rank's ``x`` (all the same shape) of a group of ``size``, in rank order."""
    if size == 1:
        return [x]
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return parts


def tp_all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (every rank gets it). Identity at tp=1."""
    if state.tp_size == 1:
        return x
    return torch.cat(_all_gather(x, state.tp_size, state.tp_group), dim=dim)


def ep_all_gather(x: torch.Tensor, state: ParallelState) -> list[torch.Tensor]:
    """Every ep rank's ``x`` (all the same shape), in rank order. ``[x]`` at ep=1."""
    return _all_gather(x, state.ep_size, state.ep_group)


def ep_all_to_all(x: torch.Tensor, send: list[int], recv: list[int], state: ParallelState) -> torch.Tensor:
    """Rows ``x`` [sum(send), ...] sent in rank order, ``send[j]`` rows to ep rank j; returns the
    ``sum(recv)`` rows received, ``recv[j]`` from rank j, in rank order. Identity at ep=1."""
    if state.ep_size == 1:
        return x
    import torch.distributed as dist

    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send,
                           group=state.ep_group)
    return out


def pp_send(x: torch.Tensor, state: ParallelState) -> None:
    """Send ``x`` to this rank's position in the next stage."""
    import torch.distributed as dist

    dist.send(x.contiguous(), dst=state.world_rank + state.world_size // state.pp_size)


def pp_recv(shape: tuple[int, ...], dtype: torch.dtype, device, state: ParallelState) -> torch.Tensor:
    """Receive the tensor the previous stage's rank of this position sends."""
    import torch.distributed as dist

    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src=state.world_rank - state.world_size // state.pp_size)
    return x


def pp_broadcast_last(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The last stage's ``x`` on every stage (in place; the others pass a buffer of its shape). Identity at pp=1."""
    if state.pp_size == 1:
        return x
    import torch.distributed as dist

    G = state.world_size // state.pp_size
    last = (state.pp_size - 1) * G + state.world_rank % G
    dist.broadcast(x, src=last, group=state.pp_group)
    return x


# --- setup ----------------------------------------------------------------------------------------------
def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an int") from None


def init_parallel(tp: int | None = None, backend: str = "gloo", *, ep: int = 1, pp: int = 1, dp: int = 1,
                  rank: int | None = None,
                  world_size: int | None = None, init_method: str | None = None, local_rank: int | None = None,
                  port: int | None = None) -> ParallelState:
    """Join the job's process group and return this process's :class:`ParallelState` (also kept as
    :func:`current`).

    ``rank``, ``world_size`` and ``local_rank`` default to torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
    (and to a job of ``pp · max(tp · dp, ep)`` processes when those are unset); ``init_method`` to ``env://`` when
    ``MASTER_ADDR`` is set, else ``tcp://127.0.0.1:<port>`` (``port``, ``MASTER_PORT`` or 29500). ``pp`` must divide
    the world size; ``tp`` defaults to a stage's ranks over ``dp`` and must divide them; ``ep`` must divide them too;
    ``dp > 1`` (attention data parallelism) takes stages of exactly ``tp · dp`` ranks, and ``ep`` 1, all of them, or
    one whose expert-TP groups (``tp · dp / ep`` ranks) divide ``tp``.
    A single process joins no group at all. Impossible layouts stop here with a ``ValueError`` naming the setting."""
    global _current
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    for name, v in (("tp", tp), ("ep", ep), ("pp", pp), ("dp", dp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    world = world_size if world_size is not None else _env_int("WORLD_SIZE")
    world = world if world is not None else pp * max((tp or 1) * dp, ep)
    tp = max(1, world // pp // dp) if tp is None else tp  # a world that pp does not divide is refused below
    check_layout(tp, ep, world, pp, dp)
    rank = rank if rank is not None else (_env_int("RANK") or 0)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, world_size={world})")
    local = local_rank if local_rank is not None else _env_int("LOCAL_RANK")
    local = rank if local is None else local
    device = None
    if backend == "nccl":
        n = torch.cuda.device_count()
        if local >= n:
            raise ValueError(f"world_size={world} needs one CUDA device per rank on each host; local rank {local} "
                             f"has none (this host has {n}: check tp, ep and CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world == 1:
        _current = ParallelState(device=device)
        return _current
    import torch.distributed as dist

    if init_method is None:
        if os.environ.get("MASTER_ADDR"):
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{port or _env_int('MASTER_PORT') or DEFAULT_PORT}"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    G = world // pp  # ranks per stage

    def group(ranks: list[int]):  # every rank creates every group, in the same order; returns its own
        g = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
        return g if rank in ranks else None

    tp_group = ep_group = pp_group = etp_group = None
    for first in range(0, world, tp):
        tp_group = group(list(range(first, first + tp))) or tp_group
    etp = expert_tp_ranks(ep, G)
    if ep > 1:  # expert group: the ranks of a stage at one position of the expert-TP groups
        for first in range(0, world, G):
            for j in range(etp):
                ep_group = group(list(range(first + j, first + G, etp))) or ep_group
    if etp > 1:  # expert-TP group: etp consecutive ranks, one of each expert group
        for first in range(0, world, etp):
            etp_group = group(list(range(first, first + etp))) or etp_group
    if pp > 1:
        for j in range(G):
            pp_group = group(list(range(j, world, G))) or pp_group
    _current = ParallelState(rank % tp, tp, tp_group, backend, device, (rank % G) // etp if ep > 1 else 0, ep, ep_group,
                             rank, world, 0, rank // G, pp, pp_group, rank % etp, etp, etp_group,
                             dp_rank=replica_of(rank, tp, dp, G), dp_size=dp)
    return _current


def expert_tp_ranks(ep: int, stage: int) -> int:
    """The ranks of an expert-TP group (``ParallelState.ep_tp_size``) in a stage of ``stage`` ranks: ``stage / ep``
    with 1 < ep < stage, else 1 (at ep = 1 the experts' width is split over tp, see ``etp_size``)."""
    return stage // ep if 1 < ep < stage else 1


def check_layout(tp: int, ep: int, world: int, pp: int = 1, dp: int = 1) -> None:
    """The ``ValueError`` naming the setting for a layout the engine cannot run."""
    if world % pp:
        raise ValueError(f"pp={pp} does not divide world_size={world}: every stage has the same number of ranks")
    stage, what = world // pp, "world_size" if pp == 1 else "world_size/pp"
    if dp > 1:
        if tp * dp != stage:
            raise ValueError(f"dp={dp} replicas of tp={tp} ranks are {tp * dp} ranks, not {what}={stage}")
        if ep not in (1, stage) and tp % (stage // ep):
            raise ValueError(f"ep={ep} with dp={dp}: attention data parallelism takes ep=1 (each replica holds "
                             f"every expert), ep=tp·dp={stage} (the experts spread over every rank), or an ep whose "
                             f"expert-TP groups of tp·dp/ep={stage // ep} ranks lie inside a replica of tp={tp}")
    if stage % tp:
        raise ValueError(f"tp={tp} does not divide {what}={stage}: every rank belongs to one tp group")
    if stage % ep:
        raise ValueError(f"ep={ep} does not divide {what}={stage}: a stage's ranks form expert groups of ep ranks "
                         f"(each expert's width split over the {what}/ep groups)")


def destroy_parallel() -> None:
    """Leave the process group (if any) and go back to :data:`SINGLE`."""
    global _current
    _current = SINGLE
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
