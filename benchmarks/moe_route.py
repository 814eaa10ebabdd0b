"""The MoE routing kernel (``moe_route`` on CUDA: sigmoid scores, group-limited top-k, renormalised weights) per
call, its two ways of picking side by side: every expert's rank counted against all the others (up to
``route_kernels.RANK_MAX`` experts) and repeated arg-max. Each time is a CUDA-graph replay of 20 calls in a row
(each waits for the one before, as a decode step's routing waits for its router), divided by 20.

    python benchmarks/moe_route.py                                  # 64, 128 and 256 experts, 1 and 32 tokens
    python benchmarks/moe_route.py --experts 64 --top-k 8 --groups 8 --topk-groups 4 --tokens 1 8 32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
from dayzero.ops.linear.kernels import graph_time  # noqa: E402
from dayzero.ops.moe import reference as ref, route_kernels as R  # noqa: E402

CALLS = 20


def time_route(T: int, E: int, k: int, groups: int, topk_groups: int, rank: bool) -> tuple[float, bool]:
    """Microseconds per call, and whether the experts picked equal the reference's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = 3 * torch.randn(T, E, device="cuda", generator=g)
    bias = 0.1 * torch.randn(E, device="cuda", generator=g)
    args = (logits, k, "sigmoid", bias, groups, topk_groups, True, 2.5)
    keep = R.RANK_MAX
    R.RANK_MAX = keep if rank else 0
    try:
        ids = R.route(*args)[1]
        us = 1e3 * graph_time([lambda: R.route(*args)] * CALLS)
    finally:
        R.RANK_MAX = keep
    same = torch.equal(ids.sort(-1).values, ref.route(*args)[1].sort(-1).values)
    return us, same


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--topk-groups", type=int, default=4)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("moe_route.py times CUDA-graph replays: it needs a CUDA device")
    print(f"{torch.cuda.get_device_name()}: top-{args.top_k}, {args.groups} groups, {args.topk_groups} kept; "
          f"us per call ({CALLS} in a row in one CUDA graph)")
    print(f"{'experts':>7} {'tokens':>6} {'rank us':>8} {'arg-max us':>10} {'ratio':>6} {'same experts':>12}")
    rows = []
    for E in args.experts:
        for T in args.tokens:
            rank, same_r = time_route(T, E, args.top_k, args.groups, args.topk_groups, True)
            argmax, same_a = time_route(T, E, args.top_k, args.groups, args.topk_groups, False)
            print(f"{E:>7} {T:>6} {rank:>8.2f} {argmax:>10.2f} {argmax / rank:>5.2f}x {str(same_r and same_a):>12}")
            rows.append({"experts": E, "tokens": T, "rank_us": rank, "argmax_us": argmax, "same": same_r and same_a})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
