"""What the benchmark scripts share: milliseconds per call after a warm-up call (CUDA events on a GPU, the wall
clock elsewhere), and the ceilings a table's percentages are of, measured in the same run: the copy bandwidth
(read + write of a large buffer) and the matmul rate (bf16 on a GPU, fp32 on a CPU); on a GPU also the time of
a call replayed from a CUDA graph."""
from __future__ import annotations

import time

import torch


def ms_per_call(fn, repeats: int, device: str = "cuda") -> float:
    fn()
    if torch.device(device).type != "cuda":
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) * 1e3 / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def ms_per_replay(fn, repeats: int) -> float | None:
    """Milliseconds per call of ``fn`` captured once in a CUDA graph and replayed (what a decode step pays inside
    the engine's graphs: no launch or host cost per kernel); None where ``fn`` cannot be captured."""
    fn()  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            fn()  # a warm call on the capture stream, as torch's graph notes ask
            with torch.cuda.graph(graph, stream=side):
                fn()
    except RuntimeError as exc:  # a host synchronisation or an unsupported op inside fn
        print(f"  (not capturable: {str(exc).splitlines()[0][:100]})")
        torch.cuda.synchronize()
        return None
    torch.cuda.current_stream().wait_stream(side)
    return ms_per_call(graph.replay, repeats, "cuda")


def timer(device: str, repeats: int):
    """fn -> mean ms per call (see :func:`ms_per_call`)."""
    return lambda fn: ms_per_call(fn, repeats, device)


def copy_bandwidth(device: str, small: bool = False) -> float:
    """Bytes per second of a large device copy (read + write)."""
    a = torch.empty(1 << (22 if small or torch.device(device).type != "cuda" else 28), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / (ms_per_call(lambda: b.copy_(a), 10, device) * 1e-3)


def ceilings(device: str, small: bool = False) -> tuple[float, float]:
    """(copy bytes/s, matmul FLOP/s) measured now."""
    n = 256 if small else 8192
    cuda = torch.device(device).type == "cuda"
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
    return copy_bandwidth(device, small), 2 * n**3 / (ms_per_call(lambda: x @ x, 5, device) * 1e-3)


def fp8_matmul_rate(device: str) -> float | None:
    """FLOP/s of an 8192³ e4m3 x e4m3 matmul through ``torch._scaled_mm`` (cuBLAS's FP8 tensor-core GEMM) measured
    now, or None where the device has no FP8 GEMM."""
    if torch.device(device).type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    n = 8192
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS takes it
    one = torch.ones((), device=device)
    try:
        fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)  # noqa: E731
        return 2 * n**3 / (ms_per_call(fn, 5, device) * 1e-3)
    except (RuntimeError, AttributeError) as exc:
        print(f"  (no FP8 GEMM to measure: {str(exc).splitlines()[0][:100]})")
        return None
