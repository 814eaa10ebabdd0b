"""The parallel layout of one process and its collectives.

One process per device. Only tensor parallelism exists so far, so every process of the job is one rank of
one tp group (tp equals the world size). A :class:`ParallelState` is a plain frozen value: the layers keep
the one they were built with, and a collective reads its group from it, never from a global. At tp=1 the
collectives return their input before anything of ``torch.distributed`` is touched.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

BACKENDS = ("gloo", "nccl")
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ParallelState:
    """``tp_rank`` of ``tp_size`` ranks in ``tp_group`` (a ``torch.distributed`` process group; None at tp=1,
    or for a layout built only to be checked or planned on the meta device, which must run no collective)."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: object = None
    backend: str | None = None
    device: torch.device | None = None  # the rank's device (cuda:LOCAL_RANK under NCCL), None: the caller's choice

    def __post_init__(self):
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp must be a positive int, got {self.tp_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp rank {self.tp_rank} is outside [0, tp={self.tp_size})")

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


def divide(n: int, state: ParallelState, what: str) -> int:
    """``n // tp``, or the ``ValueError`` naming the setting when tp does not divide it."""
    if n % state.tp_size:
        raise ValueError(f"tp={state.tp_size} does not divide {what}={n}")
    return n // state.tp_size


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


# --- setup ----------------------------------------------------------------------------------------------
def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"environment variable {name}={v!r} is not an int") from None


def init_parallel(tp: int | None = None, backend: str = "gloo", *, rank: int | None = None,
                  world_size: int | None = None, init_method: str | None = None, local_rank: int | None = None,
                  port: int | None = None) -> ParallelState:
    """Join the job's process group and return this process's :class:`ParallelState` (also kept as
    :func:`current`).

    ``rank``, ``world_size`` and ``local_rank`` default to torchrun's ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``
    (and to a job of ``tp`` processes when those are unset); ``init_method`` to ``env://`` when ``MASTER_ADDR``
    is set, else ``tcp://127.0.0.1:<port>`` (``port``, ``MASTER_PORT`` or 29500). ``tp`` defaults to the world
    size and must equal it (no other parallelism exists yet). A single process (tp=1, world size 1) joins no
    group at all. Impossible layouts stop here with a ``ValueError`` naming the setting."""
    global _current
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    world = world_size if world_size is not None else _env_int("WORLD_SIZE")
    world = world if world is not None else (tp if tp is not None else 1)
    tp = world if tp is None else tp
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive int, got {tp!r}")
    if world != tp:
        raise ValueError(f"tp={tp} with world_size={world}: only tensor parallelism exists yet, so tp must equal "
                         "the number of processes")
    rank = rank if rank is not None else (_env_int("RANK") or 0)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, world_size={world})")
    local = local_rank if local_rank is not None else _env_int("LOCAL_RANK")
    local = rank if local is None else local
    device = None
    if backend == "nccl":
        n = torch.cuda.device_count()
        if local >= n:
            raise ValueError(f"tp={tp} needs one CUDA device per rank on each host; local rank {local} has none "
                             f"(this host has {n}: check tp and CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if tp == 1:
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
    _current = ParallelState(rank, tp, dist.group.WORLD, backend, device)
    return _current


def destroy_parallel() -> None:
    """Leave the process group (if any) and go back to :data:`SINGLE`."""
    global _current
    _current = SINGLE
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
