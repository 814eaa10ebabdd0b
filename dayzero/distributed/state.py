"""The parallel layout of one process and its collectives.

One process per device. The job's ``world`` ranks hold the same sequences (attention data parallelism does not
exist yet). Attention, dense MLPs and shared experts are split over tp groups of ``tp`` consecutive ranks (with
``world / tp`` replicas of each split); routed experts are split over the ``ep`` ranks of the expert group, which
is either every rank (``ep = world``) or none (``ep = 1``, experts replicated). A :class:`ParallelState` is a
plain frozen value: the layers keep the one they were built with, and a collective reads its group from it,
never from a global. At tp=1 and ep=1 the collectives return their input before anything of
``torch.distributed`` is touched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("gloo", "nccl")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ParallelState:
    """``tp_rank`` of ``tp_size`` ranks in ``tp_group`` and ``ep_rank`` of ``ep_size`` in ``ep_group``
    (``torch.distributed`` process groups; None at size 1, or for a layout built only to be checked or planned
    on the meta device, which must run no collective)."""

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

    def __post_init__(self):
        for name in ("tp", "ep"):
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
    def single(self) -> bool:
        """True when this process runs the whole model alone (tp=1, ep=1)."""
        return self.tp_size == 1 and self.ep_size == 1

    def require_single(self, what: str) -> None:
        """Refuse tp>1 for a block that has no tensor-parallel form yet, naming it."""
        if self.tp_size > 1:
            raise ValueError(f"tp={self.tp_size}: the {what} has no tensor-parallel form yet; run it with tp=1")


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


def tp_all_gather(x: torch.Tensor, state: ParallelState, dim: int = -1) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in rank order (every rank gets it). Identity at tp=1."""
    if state.tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.tp_group)
    return torch.cat(parts, dim=dim)


def ep_all_gather(x: torch.Tensor, state: ParallelState) -> list[torch.Tensor]:
    """Every ep rank's ``x`` (all the same shape), in rank order. ``[x]`` at ep=1."""
    if state.ep_size == 1:
        return [x]
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.ep_size)]
    dist.all_gather(parts, x, group=state.ep_group)
    return parts


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


# --- setup ----------------------------------------------------------------------------------------------
def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an int") from None


def init_parallel(tp: int | None = None, backend: str = "gloo", *, ep: int = 1, rank: int | None = None,
                  world_size: int | None = None, init_method: str | None = None, local_rank: int | None = None,
                  port: int | None = None) -> ParallelState:
    """Join the job's process group and return this process's :class:`ParallelState` (also kept as
    :func:`current`).

    ``rank``, ``world_size`` and ``local_rank`` default to torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
    (and to a job of ``max(tp, ep)`` processes when those are unset); ``init_method`` to ``env://`` when
    ``MASTER_ADDR`` is set, else ``tcp://127.0.0.1:<port>`` (``port``, ``MASTER_PORT`` or 29500). ``tp`` defaults
    to the world size and must divide it; ``ep`` must be 1 or the world size. A single process joins no group at
    all. Impossible layouts stop here with a ``ValueError`` naming the setting."""
    global _current
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    for name, v in (("tp", tp), ("ep", ep)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    world = world_size if world_size is not None else _env_int("WORLD_SIZE")
    world = world if world is not None else max(tp or 1, ep)
    tp = world if tp is None else tp
    check_layout(tp, ep, world)
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
    tp_group = dist.group.WORLD
    if tp < world:  # every rank creates every group, in the same order
        for first in range(0, world, tp):
            g = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                tp_group = g
    ep_group = dist.group.WORLD if ep > 1 else None
    _current = ParallelState(rank % tp, tp, tp_group, backend, device, rank if ep > 1 else 0, ep, ep_group, rank,
                             world)
    return _current


def check_layout(tp: int, ep: int, world: int) -> None:
    """The ``ValueError`` naming the setting for a layout the engine cannot run."""
    if world % tp:
        raise ValueError(f"tp={tp} does not divide world_size={world}: every rank belongs to one tp group")
    if ep not in (1, world):
        raise ValueError(f"ep={ep} with world_size={world}: routed experts are spread over every rank (ep={world}) "
                         "or replicated (ep=1)")


def destroy_parallel() -> None:
    """Leave the process group (if any) and go back to :data:`SINGLE`."""
    global _current
    _current = SINGLE
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
