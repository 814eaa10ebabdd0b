"""A rank other than 0 of a multi-process engine: build the engine rank 0 asks for, then replay rank 0's calls
step by step (:mod:`dayzero.engine.workers` describes the messages) until rank 0 closes it or goes away. The
first rank of each replica but rank 0's (attention data parallelism) also sends its outputs and counters.

A rank that fails sends its error to rank 0 and exits at once: it may have left rank 0 inside a collective,
which only its exit ends.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import NoReturn

from dayzero.distributed import ParallelState, destroy_parallel, init_parallel
from dayzero.engine.workers import MIRRORED, describe, digest, plan_of, set_rng_state


def spawned(conn: Connection, rank: int, join: dict, parent: int) -> None:
    """The process the launcher spawns for ``rank``: joins with ``init_parallel(**join)``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every process of the terminal: rank 0 decides
    threading.Thread(target=_end_with, args=(parent,), daemon=True).start()
    try:
        state = init_parallel(**join)
    except Exception as e:
        _failed(conn, rank, "startup", e)
    run(conn, rank, state)


def run(conn: Connection, rank: int, state: ParallelState) -> None:
    """Build, answer ``ready``, replay steps until rank 0 closes; ends the process (exit status 0, or 1 after a
    failure or when rank 0 went away)."""
    from dayzero.engine.engine import LLMEngine

    try:
        kind, config = conn.recv()
        if kind != "build":
            raise RuntimeError(f"expected the engine's config from rank 0, got {kind!r}")
        engine = LLMEngine(config, parallel=state)
        conn.send(("ready", plan_of(engine)))
    except Exception as e:
        _failed(conn, rank, "startup", e)
    steps = 0
    # the first rank of another replica (in the first stage) sends its replica's outputs
    lead = state.dp_size > 1 and state.dp_rank > 0 and state.tp_rank == 0 and state.pp_rank == 0
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            os._exit(1)
        if message[0] == "close":
            break
        _, calls, rng = message
        steps += 1
        try:
            for name, args, kwargs in calls:
                if name not in MIRRORED:
                    raise ValueError(f"{name} is not a mirrored call")
                getattr(engine, name)(*args, **kwargs)
            set_rng_state(engine.device, rng, state.dp_rank)
            outputs = engine.step()
        except Exception as e:
            _failed(conn, rank, f"step {steps}", e)
        conn.send(("done", (digest(outputs), (outputs, engine.counters()) if lead else None)))
    destroy_parallel()
    sys.exit(0)


def _failed(conn: Connection, rank: int, where: str, e: Exception) -> NoReturn:
    print(f"dayzero rank {rank} failed in {where}:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    try:
        conn.send(("error", f"rank {rank} failed in {where}: {describe(e)}", isinstance(e, ValueError)))
    except OSError:
        pass
    os._exit(1)  # no interpreter shutdown: a process group in a failed collective may not tear down


def _end_with(parent: int) -> NoReturn:
    """Exit once the spawning process is gone, even from inside a rendezvous or a collective."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)
