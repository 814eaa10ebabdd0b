"""A decode step's projections as one chain of skinny-linear launches, their weights read after the wait for the
launch before (as before) or their first K step before it (``PRELOAD``), replayed from one CUDA graph.

    python benchmarks/weight_preload.py --config configs/dayzero-small.json [--rows 1] [--replays 20]

The chain holds every projection a decode step of the config runs through the skinny kernel (the fused input
projections, the routers, the output projections, the LatentMoE up-projections, the dense MLP's down projection,
as plain products of their shapes; ``decode_linear.py``'s lists), each with a weight of its own, so the step's
weights are read from memory once as in the engine. Three modes, each captured in a graph and replayed:
programmatic dependent launch off (``DAYZERO_PDL=0``), on with the weights read after the wait
(``DAYZERO_WEIGHT_PRELOAD=0``), on with the first K step read before it. The outputs of the three must be equal
bit for bit. Prints microseconds per chain and per launch and the weight bytes read per second as a share of the
copy rate measured in the run. On the CPU (Triton's interpreter) the chain runs once per mode at the config's
shapes scaled down, for the equality alone.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_linear import fused_shapes, step_shapes  # noqa: E402
from timing import copy_bandwidth  # noqa: E402

MODES = {"PDL off": {"DAYZERO_PDL": "0", "DAYZERO_WEIGHT_PRELOAD": "0"},
         "PDL, weight after the wait": {"DAYZERO_PDL": "1", "DAYZERO_WEIGHT_PRELOAD": "0"},
         "PDL, first K step before it": {"DAYZERO_PDL": "1", "DAYZERO_WEIGHT_PRELOAD": "1"}}


def chain_shapes(config: str, dtype: torch.dtype) -> list[tuple[int, int, torch.dtype, torch.dtype]]:
    """(N, K, weight dtype, out dtype) of a step's skinny-kernel products, dealt out round-robin over the shapes
    (a layer's mix of sizes follows another's, not all of one size in a row)."""
    counts = collections.Counter(step_shapes(config, dtype))
    for (op, n, k, head), c in fused_shapes(config, dtype).items():
        if op in ("rms_norm_linear", "moe_router"):  # already there: the fused input projections, the routers
            continue
        counts[(n, k - head if op == "dual_linear" else k, dtype, dtype)] += c  # dual: its first product
    out = []
    while counts:
        for shape in list(counts):
            out.append(shape)
            counts[shape] -= 1
            if not counts[shape]:
                del counts[shape]
    return out


def run_chain(calls, env: dict) -> None:
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for c in calls:
            c()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--scale", type=int, default=None, help="divide N and K by this (default: 1 on a GPU, 64 on the CPU)")
    args = ap.parse_args(argv)
    from dayzero.ops.linear import kernels as L
    from dayzero.ops.static import mark_static

    cuda = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16
    scale = args.scale or (1 if cuda else 64)
    shapes = [(max(1, n // scale), max(16, k // scale), w, o) for n, k, w, o in chain_shapes(args.config, dtype)]
    gen = torch.Generator(dev).manual_seed(0)
    calls, outs, nbytes = [], [], 0
    for n, k, wdt, out in shapes:
        w = mark_static((torch.randn(n, k, device=dev, generator=gen) / k ** 0.5).to(wdt))
        x = torch.randn(args.rows, k, device=dev, generator=gen).to(dtype)
        y = torch.empty(args.rows, n, device=dev, dtype=out)
        block = L.candidates(args.rows, n, k, L.tensor_cores(dtype, wdt))[0]
        calls.append(lambda x=x, w=w, y=y, k=k, block=block: L.launch(x, w, y, k, block))
        outs.append(y)
        nbytes += w.nbytes
    results, first = {}, None
    print(f"{args.config}: a chain of {len(calls)} skinny-linear launches at {args.rows} row(s), "
          f"{nbytes / 2**20:.1f} MiB of weights" + (f", shapes / {scale}" if scale > 1 else ""), flush=True)
    bw = copy_bandwidth("cuda") if cuda else None
    for name, env in MODES.items():
        run_chain(calls, env)  # compiles this mode's variants, eagerly
        if cuda:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run_chain(calls, env)
                with torch.cuda.graph(graph, stream=side):
                    run_chain(calls, env)
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(side)
                for _ in range(args.replays):
                    graph.replay()
                end.record(side)
                end.synchronize()
            torch.cuda.current_stream().wait_stream(side)
            results[name] = 1e3 * start.elapsed_time(end) / args.replays  # us a chain
        got = [y.clone() for y in outs]
        if first is None:
            first = got
        elif not all(torch.equal(a, b) for a, b in zip(first, got)):
            raise SystemExit(f"{name}: the chain's outputs differ from {next(iter(MODES))}'s")
    print("the chain's outputs are equal bit for bit in every mode")
    if cuda:
        base = results[next(iter(MODES))]
        print(f"copy bandwidth {bw / 1e9:,.0f} GB/s; {torch.cuda.get_device_name()}")
        print(f"{'mode':<30} {'us a chain':>11} {'us a launch':>12} {'of copy rate':>13} {'vs PDL off':>11}")
        for name, us in results.items():
            print(f"{name:<30} {us:>11.1f} {us / len(calls):>12.2f} {nbytes / (us * 1e-6) / bw:>13.1%} "
                  f"{base / us:>10.2f}x")
    return {"launches": len(calls), "weight_bytes": nbytes, "us_per_chain": results}


if __name__ == "__main__":
    main()
