"""Starting an engine of ``pp`` stages of ``max(tp · dp, ep)`` ranks: one process per rank, rank 0 the calling process.

On one host the other ranks are spawned here (``multiprocessing`` spawn, a pipe to each) and meet on
``distributed_host:distributed_port`` (loopback and a free port by default). Under torchrun (``RANK`` and
``WORLD_SIZE`` set) nothing is spawned: every process runs the same command, joins through ``env://``, and
ranks other than 0 connect to rank 0's control socket (its port and key sent by a broadcast of the process
group) and run the worker loop instead of returning. Impossible layouts stop here, before any process starts,
with the ``ValueError`` naming the setting.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, replace
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Callable

import torch

from dayzero.distributed import ParallelState, check_layout, current, expert_tp_ranks, init_parallel
from dayzero.distributed.control import broadcast_object
from dayzero.engine.device import resolve_device
from dayzero.engine.engine import DEFAULT_MODEL, EngineConfig, LLMEngine
from dayzero.engine.workers import EngineDriver, Rank

CONNECT_TIMEOUT = 300.0  # seconds rank 0 waits for the other torchrun ranks to connect to its control socket


@dataclass(frozen=True)
class Layout:
    tp: int
    ep: int
    pp: int
    dp: int
    world: int
    backend: str  # "nccl" on CUDA devices, else "gloo"
    rank: int | None  # this process's rank under torchrun; None: this process starts the others
    local_ranks: int  # ranks on this host


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or any launcher setting ``RANK`` and ``WORLD_SIZE``) started it."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def plan_layout(config: EngineConfig) -> Layout:
    """The job ``config`` asks for, or the ``ValueError`` naming the setting that cannot run here."""
    rank = torchrun_rank()
    world = int(os.environ["WORLD_SIZE"]) if rank is not None else config.pp * max(config.tp * config.dp, config.ep)
    check_layout(config.tp, config.ep, world, config.pp, config.dp)
    device = resolve_device(config.device)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if rank is not None else world
    if world > 1 and device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device={config.device!r} names one GPU but tp={config.tp}, ep={config.ep}, "
                             f"pp={config.pp} run a rank "
                             "per GPU (cuda:0, cuda:1, ..): give device='cuda' and pick GPUs with CUDA_VISIBLE_DEVICES")
        n = torch.cuda.device_count()
        if local > n:
            raise ValueError(f"tp={config.tp}, ep={config.ep}, pp={config.pp}: {local} ranks on this host need one "
                             "CUDA device each, "
                             f"it has {n} (CUDA_VISIBLE_DEVICES chooses them)")
    return Layout(config.tp, config.ep, config.pp, config.dp, world, "nccl" if device.type == "cuda" else "gloo", rank,
                  local)


def check_model_layout(config: EngineConfig, layout: Layout) -> None:
    """Build the model on the meta device as a rank would: a head count, an intermediate size or a mixer the
    layout cannot split raises its ``ValueError`` now, before any process starts."""
    from dayzero.models.registry import adapter_for, build_model, read_config

    raw, cfg_file = read_config(Path(config.model) if config.model else DEFAULT_MODEL)
    spec = adapter_for(raw, cfg_file).to_spec(raw)
    etp = expert_tp_ranks(layout.ep, layout.world // layout.pp)
    for stage in range(layout.pp):  # each stage holds other layers: each may refuse its own
        build_model(spec, torch.float32, "meta", ParallelState(
            0, layout.tp, ep_rank=0, ep_size=layout.ep, pp_rank=stage, pp_size=layout.pp,
            redundant_experts=config.num_redundant_experts, ep_tp_size=etp, dp_size=layout.dp))


def rank_config(config: EngineConfig, layout: Layout, local_rank: int) -> EngineConfig:
    """A rank's config: its own GPU; on CPUs, which share the host, its share of the cores and of the memory."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return replace(config, device=f"cuda:{local_rank}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = config.num_threads or max(1, cores // layout.local_ranks)
    return replace(config, num_threads=threads, cache_memory_fraction=config.cache_memory_fraction / layout.local_ranks)


def start_engine(config: EngineConfig) -> LLMEngine | EngineDriver:
    """The engine ``config`` describes: a plain :class:`LLMEngine` for one rank, else rank 0's engine driving the
    others. On a torchrun rank other than 0 this serves rank 0's calls and ends the process when rank 0 closes."""
    layout = plan_layout(config)
    if layout.world == 1:
        return LLMEngine(config)
    if current().backend is not None:
        raise RuntimeError("this process already belongs to a multi-process engine: close it first")
    check_model_layout(config, layout)
    if layout.rank is None:
        return _spawn(config, layout)
    if layout.rank > 0:
        _torchrun_worker(config, layout)
    return _torchrun_driver(config, layout)


def _drive(config: EngineConfig, layout: Layout, connect: Callable[[list[Rank]], list[int]], join) -> EngineDriver:
    """Rank 0: ``connect(ranks)`` adds the other ranks (and returns their local ranks), then every rank builds
    its engine; anything that fails on the way stops the ranks started so far."""
    driver = EngineDriver([])
    try:
        local = connect(driver.ranks)
        driver.start([rank_config(config, layout, r) for r in local], join,
                     lambda state: LLMEngine(rank_config(config, layout, _local_rank(0)), parallel=state))
    except BaseException:
        driver.close()
        raise
    return driver


# --- one host: spawned ranks ----------------------------------------------------------------------------
def _spawn(config: EngineConfig, layout: Layout) -> EngineDriver:
    from dayzero.engine import worker_main

    host = config.distributed_host
    port = config.distributed_port or _free_port(host)
    join = dict(tp=layout.tp, ep=layout.ep, pp=layout.pp, dp=layout.dp, backend=layout.backend, world_size=layout.world,
                init_method=f"tcp://{f'[{host}]' if ':' in host else host}:{port}")
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA context, threads or locks

    def connect(ranks: list[Rank]) -> list[int]:
        for r in range(1, layout.world):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main.spawned, args=(theirs, r, {**join, "rank": r}, os.getpid()),
                            name=f"dayzero-rank-{r}", daemon=True)
            p.start()
            theirs.close()
            ranks.append(Rank(r, mine, p))
        return list(range(1, layout.world))

    return _drive(config, layout, connect, lambda: init_parallel(**join, rank=0))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- torchrun: the ranks exist already ------------------------------------------------------------------
def _local_rank(rank: int) -> int:
    return int(os.environ.get("LOCAL_RANK", rank)) if torchrun_rank() is not None else rank


def _torchrun_driver(config: EngineConfig, layout: Layout) -> EngineDriver:
    state = init_parallel(tp=layout.tp, ep=layout.ep, pp=layout.pp, dp=layout.dp, backend=layout.backend)

    def connect(ranks: list[Rank]) -> list[int]:
        key = os.urandom(32)
        local = {}
        with socket.create_server(("", 0)) as server:
            broadcast_object((server.getsockname()[1], key))
            server.settimeout(CONNECT_TIMEOUT)
            for _ in range(layout.world - 1):
                sock, _ = server.accept()
                conn = Connection(sock.detach())
                deliver_challenge(conn, key)  # both ends prove they hold the key before anything is unpickled
                answer_challenge(conn, key)
                rank, local[rank] = conn.recv()
                ranks.append(Rank(rank, conn))
        ranks.sort(key=lambda r: r.rank)
        return [local[r.rank] for r in ranks]

    return _drive(config, layout, connect, lambda: state)


def _torchrun_worker(config: EngineConfig, layout: Layout) -> None:
    from dayzero.engine import worker_main

    state = init_parallel(tp=layout.tp, ep=layout.ep, pp=layout.pp, dp=layout.dp, backend=layout.backend)
    port, key = broadcast_object()
    conn = Client((os.environ.get("MASTER_ADDR", config.distributed_host), port), authkey=key)
    conn.send((layout.rank, _local_rank(layout.rank)))
    worker_main.run(conn, layout.rank, state)  # never returns: the process ends when rank 0 closes
