"""Routed experts, one layer: the reference (a GEMM pair per expert hit) against the CUDA ops (``moe_permute``, the
grouped GEMM of ``moe_experts_grouped``, ``moe_unpermute``), side by side in one run, with the roofline.

    python benchmarks/moe_experts.py --experts 64 --top-k 6 --hidden 4096 --inter 2048 --tokens 1 16 64 512 4096

Random bf16 weights and inputs, routing uniform at random. Each implementation runs ``--repeats`` times after a
warm-up, timed with CUDA events. The roofline of a call is max(bytes of the experts it touches / measured copy
bandwidth, 2 · 3 · D · I FLOPs per (token, expert) pair / measured bf16 matmul rate).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import ceilings, ms_per_call  # noqa: E402
from dayzero.ops.moe import cuda as moe_cuda  # noqa: E402
from dayzero.ops.moe.reference import grouped_experts as reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--inter", type=int, default=2048)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 512, 4096])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    E, k, D, inter = args.experts, args.top_k, args.hidden, args.inter
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (0.02 * torch.randn(E, 2 * inter, D, generator=g, device="cuda")).to(torch.bfloat16)
    w2 = (0.02 * torch.randn(E, D, inter, generator=g, device="cuda")).to(torch.bfloat16)
    bw, flops = ceilings("cuda")
    print(f"{E} experts top-{k}, D {D}, I {inter}, bf16; measured copy {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.0f} TFLOP/s")
    print(f"{'tokens':>7} {'experts hit':>11} {'reference ms':>13} {'grouped ms':>11} {'speedup':>8} {'roofline ms':>12} {'of roofline':>12}")
    rows = []
    for T in args.tokens:
        x = torch.randn(T, D, generator=g, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g, device="cuda")[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g, device="cuda")
        hit = int(ids.unique().numel())
        ref_ms = ms_per_call(lambda: reference(x, ids, w, w1, w2), args.repeats)
        new_ms = ms_per_call(lambda: moe_cuda.grouped_experts(x, ids, w, w1, w2), args.repeats)
        roof_ms = 1e3 * max(hit * 3 * D * inter * 2 / bw, 2 * 3 * D * inter * T * k / flops)
        rows.append({"tokens": T, "experts_hit": hit, "reference_ms": ref_ms, "grouped_ms": new_ms, "roofline_ms": roof_ms})
        print(f"{T:>7} {hit:>11} {ref_ms:>13.3f} {new_ms:>11.3f} {ref_ms / new_ms:>7.1f}x {roof_ms:>12.3f} {roof_ms / new_ms:>11.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bandwidth": bw, "flops": flops, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
