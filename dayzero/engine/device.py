"""Which device and how many CPU threads an engine runs with: a device that is not there is refused by name,
and on a machine that other processes load the CPU threads are cut to the cores they leave free."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("dayzero")


def resolve_device(name: str) -> torch.device:
    """``name`` ("auto", "cpu", "cuda", "cuda:N") as a device of this machine. A device that is not there
    raises ValueError naming what was asked for and what exists."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if dev.type == "cpu":
        return dev
    if not torch.cuda.is_available():
        why = (f"this torch ({torch.__version__}) is built without CUDA" if torch.version.cuda is None
               else "no CUDA GPU is visible")
        raise ValueError(f"device {name!r} is not available: {why}; this machine has: cpu")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        gpus = ", ".join(f"cuda:{i}" for i in range(n))
        raise ValueError(f"device {name!r} is not available: this machine has {n} CUDA device{'s' * (n != 1)} "
                         f"({gpus}) and cpu")
    return dev


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def configure_threads(requested: int | None = None) -> int:
    """Set torch's CPU threads and log the choice: ``requested``; else, when other processes load the
    machine (1-minute load average against the usable cores), the cores they leave free, at least 1; else
    torch's own count. Never more than torch's count unless asked: a busy machine with every core taken
    by one process each makes torch's threads wait on each other (a 128-token prefill on 2 loaded cores:
    13 s with 2 threads, 0.15 s with 1)."""
    current = torch.get_num_threads()
    if requested is not None:
        n, why = requested, "as asked"
    else:
        cores = _usable_cores()
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # no load average on this platform
            load = 0.0
        free = max(1, int(cores - load + 0.5))
        if free < current:
            n, why = free, (f"{cores} cores with a load average of {load:.2f} from other work; "
                            f"num_threads / --threads to choose")
        else:
            n, why = current, f"torch's default, {cores} cores, load average {load:.2f}"
    if n != current:
        torch.set_num_threads(n)
    log.info("cpu threads: %d (%s)", n, why)
    return n
