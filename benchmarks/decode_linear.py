"""A decode step's projections, cuBLAS against the skinny Triton kernel, at a model config's shapes.

    python benchmarks/decode_linear.py --config configs/dayzero-small.json --rows 1 2 4 8

The model is built on the meta device to list the projections a decode step runs through the ``linear`` op
(the fused input projections of every mixer and LatentMoE block, and the fp32 router GEMV) with how many of each
a step runs. Each shape is timed replayed from a CUDA graph over copies of its weight that overflow the L2
cache (``dayzero.ops.linear.kernels.timings``, what the op measures), cuBLAS and every block shape it chooses
among; the table gives microseconds and the weight bytes read per second as a share of the copy bandwidth measured
in the run (bytes read and written per second by a large copy). The last lines sum a step's time over the
shapes: cuBLAS only against the op's choice (Triton where it is at least 5% faster).

A second table times the ops that run another kernel's work inside the skinny kernel, at the shapes a step runs
them: ``rms_norm_linear`` (the input norm inside each mixer's fused projection), ``act_linear`` (the dense MLPs'
activation inside their down projections), ``rms_norm_gated_linear`` (KDA's gated output norm inside its output
projection), ``dual_linear`` (a LatentMoE block's up-projection with its shared expert's activation and down
projection), ``moe_router`` (the router GEMV with the routing) and ``sigmoid_gate_linear`` (gated attention's output
gate inside its output projection), each against its kernels apart (each as its op chooses), as the ops measure
it at their first call.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copy_bandwidth  # noqa: E402


def step_shapes(config: str, dtype: torch.dtype) -> dict[tuple, int]:
    """(N, K, weight dtype, out dtype) -> how many a decode step runs through the ``linear`` op."""
    from dayzero.layers.fused import fuse
    from dayzero.layers.moe import MoE
    from dayzero.models.registry import build_model, load_config

    model = build_model(load_config(config), dtype, "meta")
    shapes = collections.Counter()
    for mod in model.modules():
        members = getattr(mod, "in_proj_members", None)
        if members and fuse(mod, "fused_in", members):
            w = mod.fused_in.weight
            shapes[(w.shape[0], w.shape[1], w.dtype, w.dtype)] += 1
        if isinstance(mod, MoE):
            w = mod.gate.weight
            shapes[(w.shape[0], w.shape[1], w.dtype, torch.float32)] += 1
    return dict(shapes)


def fused_shapes(config: str, dtype: torch.dtype) -> dict[tuple, int]:
    """(op, N, K, head) -> how many a decode step runs: the norm inside each fused input projection, the
    activation inside each MLP's down projection, KDA's gated norm inside its output projection (head: its head
    size), a LatentMoE block's up-projection with its shared expert (K: the two in-features, head: the shared
    expert's), each MoE router with its routing, each gated attention's output projection (head: its head size)."""
    from dayzero.layers.attention.kda import KDAAttention
    from dayzero.layers.fused import fuse
    from dayzero.layers.mlp import MLP
    from dayzero.layers.moe import MoE
    from dayzero.models.registry import build_model, load_config

    model = build_model(load_config(config), dtype, "meta")
    shapes, in_dual = collections.Counter(), set()
    for mod in model.modules():  # a block before its children
        members = getattr(mod, "in_proj_members", None)
        if members and getattr(mod, "takes_projected", False) and fuse(mod, "fused_in", members):
            shapes[("rms_norm_linear", *mod.fused_in.weight.shape, 0)] += 1
        if isinstance(mod, MoE) and mod._shared_in_up_projection({"shared_experts.gate_up_proj": None}):
            w, w2 = mod.fc2_latent_proj.weight, mod.shared_experts.down_proj.weight
            shapes[("dual_linear", w.shape[0], w.shape[1] + w2.shape[1], w2.shape[1])] += 1
            in_dual.add(mod.shared_experts)
        elif isinstance(mod, MLP) and mod not in in_dual:
            shapes[("act_linear", *mod.down_proj.weight.shape, 0)] += 1
        if isinstance(mod, MoE) and mod.tid2eid is None:
            shapes[("moe_router", *mod.gate.weight.shape, 0)] += 1
        gated = getattr(mod, "g_proj", None) is not None or getattr(getattr(mod, "spec", None), "output_gate", None)
        if gated and hasattr(mod, "o_proj"):
            w = mod.o_proj.weight
            shapes[("sigmoid_gate_linear", w.shape[0], w.shape[1], w.shape[1] // mod.H)] += 1
        if isinstance(mod, KDAAttention):
            shapes[("rms_norm_gated_linear", *mod.o_proj.weight.shape, mod.K)] += 1
    return dict(shapes)


def time_fused(op: str, rows: int, n: int, k: int, head: int, dev, dtype) -> dict:
    """The op's own timings (apart under None, the fused launch per block shape), in microseconds."""
    from dayzero.ops.linear import act as A, norm as N

    w = (torch.randn(n, k, device=dev) / k ** 0.5).to(dtype)
    if op == "rms_norm_linear":
        x = torch.randn(rows, k, device=dev).to(dtype)
        times = N.timings(x, x, torch.ones(k, device=dev, dtype=dtype), 1e-6, w)
    elif op == "act_linear":
        times = A.timings(torch.randn(rows, 2 * k, device=dev).to(dtype), w)
    elif op == "sigmoid_gate_linear":  # head: the head size; a gate per channel
        x = torch.randn(rows, k // head, head, device=dev).to(dtype)
        times = A.gate_timings(x, torch.randn_like(x), w)
    elif op == "moe_router":  # dayzero-small's routing: sigmoid, 8 groups, 4 kept, top-8
        from dayzero.ops.moe import router_kernels as R

        times = R.timings(torch.randn(rows, k, device=dev).to(dtype), w.float(), None, 8, "sigmoid",
                          torch.zeros(n, device=dev), 8, 4)
    elif op == "dual_linear":  # k = K1 + K2, head = K2
        w2 = (torch.randn(n, head, device=dev) / head ** 0.5).to(dtype)
        x, x2 = torch.randn(rows, k - head, device=dev).to(dtype), torch.randn(rows, 2 * head, device=dev).to(dtype)
        times = A.dual_timings(x, w[:, :k - head].contiguous(), x2, w2, "silu")
    else:
        x = torch.randn(rows, k // head, head, device=dev).to(dtype)
        times = N.gated_timings(x, torch.ones(head, device=dev, dtype=dtype), x, 1e-6, w)
    return {b: 1e3 * t for b, t in times.items()}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args(argv)
    from dayzero.ops.linear import kernels as L

    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth("cuda")  # bytes moved per second (read + write) by a large copy
    shapes = step_shapes(args.config, dtype)
    print(f"{args.config} on {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:,.0f} GB/s; "
          f"{sum(shapes.values())} projections a step through the linear op")
    print(f"{'rows':>4} {'N x K':>12} {'weight':>7} {'/step':>5} {'cuBLAS us':>9} {'of bw':>6} {'Triton us':>9} "
          f"{'of bw':>6} {'block':>14} {'ratio':>6}")
    rows_out, totals = [], collections.defaultdict(lambda: [0.0, 0.0])
    for rows in args.rows:
        for (n, k, wdt, out), count in sorted(shapes.items(), key=lambda s: -s[0][0] * s[0][1]):
            w = (torch.randn(n, k, device=dev) / k ** 0.5).to(wdt)
            x = torch.randn(rows, k, device=dev).to(dtype)
            us = {b: 1e3 * t for b, t in L.timings(x, w, None, out).items()}  # what the op measures, in us
            t_ref, best = us[None], L.fastest_triton(us)
            nbytes = w.nbytes
            totals[rows][0] += count * t_ref
            totals[rows][1] += count * us[L.fastest(us)]
            print(f"{rows:>4} {f'{n} x {k}':>12} {str(wdt).removeprefix('torch.'):>7} {count:>5} {t_ref:>9.2f} "
                  f"{nbytes / (t_ref * 1e-6) / bw:>6.0%} {us[best]:>9.2f} {nbytes / (us[best] * 1e-6) / bw:>6.0%} "
                  f"{str(best):>14} {t_ref / us[best]:>5.2f}x", flush=True)
            rows_out.append({"rows": rows, "n": n, "k": k, "weight_dtype": str(wdt), "per_step": count,
                             "cublas_us": t_ref, "triton_us": us[best], "block": best})
    for rows, (ref, chosen) in totals.items():
        print(f"rows {rows}: a step's projections through the op {ref:.1f} us with cuBLAS, {chosen:.1f} us as chosen "
              f"({ref / chosen:.2f}x)")
    fused = fused_shapes(args.config, dtype)
    print(f"\n{'rows':>4} {'op':>21} {'N x K':>12} {'/step':>5} {'apart us':>9} {'fused us':>9} {'block':>14} "
          f"{'ratio':>6}")
    saved = collections.Counter()
    for rows in args.rows:
        for (op, n, k, head), count in sorted(fused.items()):
            us = time_fused(op, rows, n, k, head, dev, dtype)
            best = min((b for b in us if b is not None), key=us.get)
            saved[rows] += count * max(0.0, us[None] - us[best])
            print(f"{rows:>4} {op:>21} {f'{n} x {k}':>12} {count:>5} {us[None]:>9.2f} {us[best]:>9.2f} {str(best):>14} "
                  f"{us[None] / us[best]:>5.2f}x", flush=True)
            rows_out.append({"rows": rows, "op": op, "n": n, "k": k, "per_step": count, "apart_us": us[None],
                             "fused_us": us[best], "block": best})
    for rows, us in saved.items():
        print(f"rows {rows}: the fused launches save {us:.1f} us a step where they run")
    return rows_out


if __name__ == "__main__":
    main()
