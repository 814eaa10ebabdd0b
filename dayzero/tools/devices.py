"""Accelerator kinds the planner knows: memory, bandwidths and peak throughput per device.

Figures are the vendors' published peaks for one device: usable memory as the runtime reports it (GiB),
HBM bandwidth (TB/s), dense BF16 tensor throughput (TFLOP/s, no sparsity), and the scale-up link (NVLink,
Infinity Fabric) in GB/s per direction per device. Any other accelerator is described on the command line
with ``--device-spec name:mem_gib:tbps:tflops:link_gbps``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceKind:
    name: str
    mem_gib: float  # usable device memory
    tbps: float  # memory bandwidth, TB/s
    tflops: float  # dense BF16 peak, TFLOP/s
    link_gbps: float  # scale-up link, GB/s per direction per device
    node_size: int = 8  # devices joined by the scale-up link; beyond it, the scale-out network
    net_gbps: float = 50.0  # scale-out bandwidth per device, GB/s per direction (one 400 Gb/s NIC)
    latency_us: float = 10.0  # fixed cost of one collective inside a node
    net_latency_us: float = 25.0  # ... and across nodes

    @property
    def mem_bytes(self) -> float:
        return self.mem_gib * 2**30

    def describe(self) -> str:
        return (f"{self.name}: {self.mem_gib:g} GiB, {self.tbps:g} TB/s, {self.tflops:g} TFLOP/s bf16, "
                f"link {self.link_gbps:g} GB/s")


DEVICES = {d.name.lower(): d for d in (
    DeviceKind("H100", 79.6, 3.35, 989, 450),
    DeviceKind("H200", 139.8, 4.8, 989, 450),
    DeviceKind("B200", 178.4, 8.0, 2250, 900),
    DeviceKind("MI300X", 191.5, 5.3, 1307, 448),
)}


def parse_device_spec(text: str) -> DeviceKind:
    """``name:mem_gib:tbps:tflops:link_gbps``, e.g. ``npu:96:1.6:320:200``."""
    parts = text.split(":")
    if len(parts) != 5 or not parts[0]:
        raise ValueError(f"--device-spec must be name:mem_gib:tbps:tflops:link_gbps, got {text!r}")
    try:
        mem, tbps, tflops, link = (float(p) for p in parts[1:])
    except ValueError:
        raise ValueError(f"--device-spec {text!r}: memory, bandwidth, TFLOP/s and link must be numbers") from None
    if min(mem, tbps, tflops, link) <= 0:
        raise ValueError(f"--device-spec {text!r}: every figure must be positive")
    return DeviceKind(parts[0], mem, tbps, tflops, link)


def parse_devices(text: str, custom: list[DeviceKind] = ()) -> tuple[int, DeviceKind]:
    """``16xH200`` (case-insensitive; a bare kind means one device) -> (16, H200)."""
    m = re.fullmatch(r"\s*(?:(\d+)\s*[xX*]\s*)?([\w.-]+)\s*", text)
    if m is None:
        raise ValueError(f"--devices must look like 16xH200, got {text!r}")
    n = int(m.group(1) or 1)
    kinds = {**DEVICES, **{d.name.lower(): d for d in custom}}
    kind = kinds.get(m.group(2).lower())
    if kind is None:
        raise ValueError(f"unknown device kind {m.group(2)!r}; known: {sorted(d.name for d in kinds.values())}; "
                         f"describe others with --device-spec name:mem_gib:tbps:tflops:link_gbps")
    if n < 1:
        raise ValueError("--devices needs at least one device")
    return n, kind
