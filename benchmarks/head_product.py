"""MLA's two per-head products of a decode step's few rows, the Triton launch (``head_kernels.head_product``)
against the einsum (a batched cuBLAS GEMM), side by side in one run, per row count.

    python benchmarks/head_product.py                     # dayzero-small's shapes: 16 heads, 128 x 512, rows 1 2 4 8
    python benchmarks/head_product.py --rows 1 4 --copies 32

Absorbed MLA multiplies each head's rows by its slice of ``kv_b_proj`` twice a layer: q_nope · W_UK ([T, H, N] by
[H, N, R]) and o_lat · W_UVᵀ ([T, H, R] by [H, V, R]ᵀ), both views of the one stored weight [H·(N+V), R]. On a GPU
both products over ``--copies`` copies of that weight (past the L2 cache, as the layers of a step are) are
replayed from one CUDA graph; prints µs a product, the ratio and the weight's read rate. On the CPU (Triton's
interpreter, for the tests) each runs once and the largest difference between them is printed.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import ms_per_replay  # noqa: E402


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--nope", type=int, default=128, help="qk_nope_head_dim (N)")
    ap.add_argument("--v", type=int, default=128, help="v_head_dim (V)")
    ap.add_argument("--rank", type=int, default=512, help="kv_lora_rank (R)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--copies", type=int, default=32, help="weight copies a replay goes through")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    from dayzero.ops.attention import head_kernels as HK
    from dayzero.ops.static import mark_static

    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    H, N, V, R = args.heads, args.nope, args.v, args.rank
    g = torch.Generator().manual_seed(0)
    copies = args.copies if cuda else 1
    ws = [mark_static((torch.randn(H * (N + V), R, generator=g) / R ** 0.5).to(dt).to(dev)) for _ in range(copies)]
    nbytes = H * (N + V) * R * ws[0].element_size() // 2  # a product reads its half of the weight (N = V)
    print(f"{torch.cuda.get_device_name() if cuda else 'cpu (interpreter, untimed)'}: {H} heads, N {N}, V {V}, "
          f"R {R}, {dt}; {copies} weight copies")
    print(f"{'rows':>4} {'einsum us':>10} {'kernel us':>10} {'ratio':>7} {'kernel GB/s':>12} {'max diff':>9}")
    out = []
    for rows in args.rows:
        q = torch.randn(rows, H, N, generator=g).to(dt).to(dev)
        o = torch.randn(rows, H, R, generator=g).to(dt).to(dev)

        def einsum():
            res = []
            for w in ws:
                v = w.view(H, N + V, R)
                res.append(torch.einsum("thi,hij->thj", q, v[:, :N]))
                res.append(torch.einsum("thi,hij->thj", o, v[:, N:].transpose(1, 2)))
            return res

        def kernel():
            res = []
            for w in ws:
                v = w.view(H, N + V, R)
                res.append(HK.head_product(q, v[:, :N], w))
                res.append(HK.head_product(o, v[:, N:].transpose(1, 2), w))
            return res

        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(einsum(), kernel()))
        row = {"rows": rows, "max_diff": diff, "einsum_us": None, "kernel_us": None}
        if cuda:
            a, b = (ms_per_replay(f, args.replays) for f in (einsum, kernel))
            if a is not None and b is not None:
                row["einsum_us"], row["kernel_us"] = (1e3 * t / (2 * copies) for t in (a, b))
        if row["kernel_us"]:
            e, k = row["einsum_us"], row["kernel_us"]
            print(f"{rows:>4} {e:>10.2f} {k:>10.2f} {e / k:>6.2f}x {nbytes / (k * 1e3):>12,.0f} {diff:>9.1e}")
        else:
            print(f"{rows:>4} {'-':>10} {'-':>10} {'-':>7} {'-':>12} {diff:>9.1e}")
        out.append(row)
    return out


if __name__ == "__main__":
    main()
