"""Host→device copies that never make the host wait for the device.

``torch.tensor(values, device="cuda")`` builds the tensor in pageable host memory and copies it
with a blocking copy: the host waits until everything already queued on the stream has run.
A copy out of page-locked (pinned) memory with ``non_blocking=True`` is queued on the current
stream like a kernel instead, so the kernels queued after it see the data and the host moves on.
"""
from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """``values`` (a possibly nested list of numbers, or a tensor) as a ``dtype`` tensor on
    ``device``, without a host synchronisation.

    On the CPU this is a plain tensor (it may alias a tensor given as ``values``); a tensor
    already on a device is moved directly. On CUDA the values are staged in pinned memory from
    PyTorch's caching host allocator, which records the copy on its stream and hands that block
    out again only once the copy has run, so the staging tensor may be dropped at once.
    """
    device = torch.device(device)
    pin = device.type == "cuda"  # never pin without CUDA: pinning needs a CUDA context
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device, dtype)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype)
        if pin and not host.is_pinned():
            host = host.pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=pin)
    if device.type == "cpu":
        return host
    # non_blocking only from pinned memory: from pageable memory it would not be asynchronous
    return host.to(device, non_blocking=pin)
