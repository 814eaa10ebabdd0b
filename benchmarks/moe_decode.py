"""A decode step's MoE routing and routed experts, layer after layer: routing as its own kernel against routing
inside the first expert kernel, side by side in one run.

    python benchmarks/moe_decode.py --config configs/dayzero-small.json --rows 1 4 [--layers 23] [--replays 50]
        [--up-warps 4 2 1] [--dual] [--early [--up-widths 16 32] [--down-widths 2 4] [--down-warps 4]
        [--up-blocks 16:512:8]]

Each of ``--layers`` layers has weights of its own (the config's router, fp32, and its routed experts in bf16;
random) and feeds the next: its routed output is the next layer's expert input, its router input stays the step's
row. Two chains of the same layers run:

- ``apart``: the router GEMV (the ``linear`` op, fp32 out), the routing kernel (``moe_route``), then the two
  direct expert kernels reading the ids and weights it wrote (``direct_kernels.moe_experts_direct``): 4 kernels;
- ``inside``: the router GEMV, then the two direct kernels, the first routing its token itself
  (``direct_kernels.moe_experts_routed``, what ``moe_experts_routed`` runs on a decode step's few pairs): 3;
  with ``--up-warps``, once per warp count of that first kernel (the engine's is the first, 4), since each of
  its programs now routes a token, whose reductions cost more across more warps.

On a GPU each chain is captured in a CUDA graph and replayed (programmatic dependent launch as the engine runs
it); prints µs a chain and a layer, the ratio and the largest difference between the chains' outputs. On the CPU
(Triton's interpreter, shapes divided by ``--scale``) the chains run once, for the tests.

``--dual``: the block's output too, as a LatentMoE layer ends (rows routed inside the first kernel): the latent
up-projection of the routed sum plus the shared expert's activation and down-projection (``dual_linear``), apart
(two skinny/cuBLAS ops as chosen) and as one launch at each block shape, its weights' first K steps read before
the wait (``early``) or after it; each layer's output's first L columns, copied, are the next layer's expert
input. Prints µs a layer and what the output adds to the chain without it.

``--early``: each layer as a LatentMoE layer that routes first runs it: the router's GEMV, the experts' input
projection, then the two expert kernels, the first routing after its wait (``late``) or before it with its
expert's first weight step (``moe_experts_routed(early=True)``): the second kernel ranking its slots' experts
after its wait (``early, up only``) or before it with their first weight step (``early``; the engine's choice
from ``direct_kernels.DOWN_EARLY_ROWS`` tokens), the latter at the default column blocks and at the first kernel's
widths ``--up-widths`` (fewer, wider programs: more of them resident beside the projection's) and the second's
``--down-widths``, and with the second kernel's warps ``--down-warps`` (ranking early from the engine's
``DOWN_EARLY_ROWS``); ``--up-blocks BN:BK:WARPS``: the first kernel at these columns, K step (the part of each
half read before the wait) and warps, the second as the engine runs it. Weights are marked as model weights, so every launch reads its first step early.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import ms_per_replay  # noqa: E402


def moe_shapes(config: str) -> dict:
    """The config's routed-MoE shapes: D (router input), L (expert input), I, E, S (the shared expert's width), the
    number of MoE layers, whether the router has a correction bias, and ``route(bias)``: ``moe_route``'s arguments
    after the logits, as the layer passes them (``MoE.route_args``) with the correction bias ``bias``."""
    from dayzero.layers.moe import MoE
    from dayzero.models.registry import load_config

    spec = load_config(config)
    layers = [layer.mlp for layer in spec.layers if layer.mlp_kind == "moe"]
    if not layers:
        raise SystemExit(f"{config} has no MoE layers")
    s = layers[-1]
    with torch.device("meta"):  # the layer's own routing arguments, no weights allocated
        moe = MoE(spec.hidden_size, s)
    args = moe.route_args()
    return dict(D=spec.hidden_size, L=s.latent_size or spec.hidden_size, I=s.intermediate_size, E=s.n_experts,
                S=s.shared_intermediate_size or s.intermediate_size,
                layers=len(layers), correction_bias=moe.e_score_correction_bias is not None, top_k=s.top_k,
                route=lambda bias: tuple({**args, "correction_bias": bias}.values()))


def print_table(rows_out: list[dict], n_layers: int) -> None:
    """µs a chain and a layer per rows and mode (None: not timed), each against ``apart``."""
    print(f"{'rows':>4} {'mode':<18} {'us a chain':>11} {'us a layer':>11} {'vs apart':>9}")
    for r in rows_out:
        base = r["us"].get("apart")
        for name, us in r["us"].items():
            if us is None:
                print(f"{r['rows']:>4} {name:<18} {'-':>11} {'-':>11} {'-':>9}")
                continue
            ratio = f"{base / us:>8.2f}x" if base else f"{'-':>9}"
            print(f"{r['rows']:>4} {name:<18} {us:>11.1f} {us / n_layers:>11.2f} {ratio}")
        print(f"{r['rows']:>4} largest difference from apart: {r['max_diff']:.2e}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=None, help="default: the config's MoE layers")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--up-warps", type=int, nargs="+", default=[4], help="warps of the routing expert kernel")
    ap.add_argument("--dual", action="store_true", help="time the block's output launch (see the docstring)")
    ap.add_argument("--early", action="store_true", help="time the routing before the wait (see the docstring)")
    ap.add_argument("--up-widths", type=int, nargs="+", default=[16, 32],
                    help="with --early: the first kernel's column blocks to time besides its default")
    ap.add_argument("--down-widths", type=int, nargs="+", default=[],
                    help="with --early: the second kernel's column blocks to time besides its default")
    ap.add_argument("--down-warps", type=int, nargs="+", default=[],
                    help="with --early: the second kernel's warps to time besides its default (8)")
    ap.add_argument("--up-blocks", nargs="+", default=[], metavar="BN:BK:WARPS",
                    help="with --early: the first kernel's (columns, K step, warps) to time, the second as the "
                         "engine runs it")
    ap.add_argument("--scale", type=int, default=None, help="divide D, L and I by this (default: 1 on a GPU, 32 on "
                                                            "the CPU)")
    args = ap.parse_args(argv)
    from dayzero import ops
    from dayzero.ops.moe import direct_kernels as D
    from dayzero.ops.moe.route_kernels import route

    cuda = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16
    scale = args.scale or (1 if cuda else 32)
    m = moe_shapes(args.config)
    (Dm, L, I), E = (max(16, m[n] // scale) for n in ("D", "L", "I")), m["E"]
    n_layers = args.layers or m["layers"]
    gen = torch.Generator(dev).manual_seed(0)
    layers = []
    for _ in range(n_layers):
        rw = torch.randn(E, Dm, device=dev, generator=gen) / Dm ** 0.5 * 3  # fp32, as routers are kept
        bias = 0.1 * torch.randn(E, device=dev, generator=gen) if m["correction_bias"] else None
        w1 = (torch.randn(E, 2 * I, L, device=dev, generator=gen) / L ** 0.5).to(dtype)
        w2 = (torch.randn(E, L, I, device=dev, generator=gen) / I ** 0.5).to(dtype)
        layers.append((rw, bias, w1, w2))
    print(f"{args.config}: {n_layers} MoE layers of {E} experts (top-{m['top_k']}), router {E} x {Dm} fp32, experts "
          f"{L} -> {I} bf16" + (f" (shapes / {scale})" if scale > 1 else "") + f"; {dev}", flush=True)

    def chain(x, h0, warps: int | None):  # warps None: the routing kernel apart
        h = h0
        for rw, bias, w1, w2 in layers:
            logits = ops.call("linear", x, rw, None, out_dtype=torch.float32)
            if warps:
                h = D.moe_experts_routed(h, logits, m["route"](bias), w1, w2, up_warps=warps)[0]
            else:
                weights, ids = route(logits, *m["route"](bias))
                h = D.moe_experts_direct(h, ids, weights, w1, w2)
        return h

    if args.dual:
        return dual_chains(args, m, layers, Dm, L, dev, dtype, gen, cuda, scale)
    if args.early:
        return early_chains(args, m, layers, Dm, L, dev, dtype, gen, cuda)
    rows_out = []
    for rows in args.rows:
        x = torch.randn(rows, Dm, device=dev, generator=gen).to(dtype)
        h0 = torch.randn(rows, L, device=dev, generator=gen).to(dtype)
        why = D.routed_refusal(h0, m["route"](layers[0][1]), layers[0][2], layers[0][3])
        if why:
            print(f"{rows} rows: {why}; skipped")
            continue
        outs, us = {}, {}
        modes = {"apart": None, **{f"inside, {w} warps": w for w in args.up_warps}}
        for name, warps in modes.items():
            outs[name] = chain(x, h0, warps)
            if cuda:
                ms = ms_per_replay(lambda w=warps: chain(x, h0, w), args.replays)
                us[name] = None if ms is None else 1e3 * ms
        diff = max((o.float() - outs["apart"].float()).abs().max().item() for o in outs.values())
        rows_out.append(dict(rows=rows, us=us, max_diff=diff))
    print_table(rows_out, n_layers)
    return {"layers": n_layers, "rows": rows_out}


def time_variants(rows: int, variants: dict, chain, n_layers: int, replays: int, cuda: bool, reference: str,
                  against: str, skip: tuple = ()) -> dict:
    """``chain(variant)`` of every variant (by name), and on a GPU its µs a layer replayed from a CUDA graph,
    printed beside the first variant's (``against``: "adds", the difference; "ratio", the first's time over it);
    then the largest difference of the outputs (those named in ``skip`` aside) from the ``reference`` variant's."""
    width = max(map(len, variants))
    print(f"{rows} rows: {'variant':<{width}} {'us a layer':>11} {'vs ' + next(iter(variants)):>12}")
    got, times, base = {}, {}, None
    for name, v in variants.items():
        got[name] = chain(v).float()
        if not cuda:
            continue
        ms = ms_per_replay(lambda v=v: chain(v), replays)
        times[name] = us = None if ms is None else 1e3 * ms / n_layers
        if us is None:
            print(f"{rows:>4} rows: {name:<{width}} {'-':>11} {'-':>12}", flush=True)
            continue
        base = us if base is None else base
        versus = f"{us - base:+.2f}" if against == "adds" else f"{base / us:.2f}x"
        print(f"{rows:>4} rows: {name:<{width}} {us:>11.2f} {versus:>12}", flush=True)
    diff = max((o - got[reference]).abs().max().item() for n, o in got.items() if n not in skip)
    print(f"{rows:>4} rows: largest difference from {reference}: {diff:.2e}")
    return dict(rows=rows, us=times, max_diff=diff, variants=list(variants))


def dual_chains(args, m, layers, Dm, L, dev, dtype, gen, cuda, scale: int) -> dict:
    """``--dual``: each layer's router, routed experts and output launch, per variant of the output."""
    from dayzero import ops
    from dayzero.ops.linear import act as A, kernels as K
    from dayzero.ops.moe import direct_kernels as D
    from dayzero.ops.static import mark_static

    shared = max(16, m["S"] // scale)  # the shared expert's width
    outs = [(mark_static((torch.randn(Dm, L, device=dev, generator=gen) / L ** 0.5).to(dtype)),
             mark_static((torch.randn(Dm, shared, device=dev, generator=gen) / shared ** 0.5).to(dtype)))
            for _ in layers]
    results = []
    for rows in args.rows:
        x = torch.randn(rows, Dm, device=dev, generator=gen).to(dtype)
        h0 = torch.randn(rows, L, device=dev, generator=gen).to(dtype)
        x2 = torch.randn(rows, 2 * shared, device=dev, generator=gen).to(dtype)  # the shared expert's [gate | up]

        def chain(variant):
            h = h0
            for (rw, bias, w1, w2), (wu, ws) in zip(layers, outs):
                logits = ops.call("linear", x, rw, None, out_dtype=torch.float32)
                y = D.moe_experts_routed(h, logits, m["route"](bias), w1, w2)[0]
                if variant is None:
                    h = y
                    continue
                if variant == "apart":
                    out = ops.call("linear", y, wu, add=ops.call("act_linear", x2, ws, None, "silu", None))
                else:
                    out = torch.empty(rows, Dm, device=dev, dtype=dtype)
                    K.launch(y, wu, out, L, variant[0], activation="silu", second=(x2, ws), early=variant[1])
                h = out[:, :L].contiguous()
            return h

        variants = {"experts only": None, "output apart": "apart"}
        for b in A.dual_candidates(rows, Dm, L, shared):
            variants[f"output {b}, early"] = (b, True)
            variants[f"output {b}, after"] = (b, False)
        results.append(time_variants(rows, variants, chain, len(layers), args.replays, cuda, "output apart",
                                     "adds", skip=("experts only",)))
    return {"layers": len(layers), "dual": results}


def early_chains(args, m, layers, Dm, L, dev, dtype, gen, cuda) -> dict:
    """``--early``: router, projection and the expert kernels per layer, routed after or before the wait."""
    from dayzero import ops
    from dayzero.ops.moe import direct_kernels as D
    from dayzero.ops.static import mark_static
    from dayzero.ops.triton_support import next_pow2

    for rw, _, w1, w2 in layers:
        mark_static(rw), mark_static(w1), mark_static(w2)
    projs = [mark_static((torch.randn(L, Dm, device=dev, generator=gen) / Dm ** 0.5).to(dtype)) for _ in layers]
    I, k = layers[0][3].shape[-1], m["top_k"]
    results = []
    for rows in args.rows:
        x = torch.randn(rows, Dm, device=dev, generator=gen).to(dtype)
        want = D._programs_wanted(dev)
        up, down = D.blocks(rows * k, I, L, want, "bfloat16"), D.down_blocks(rows, k, L, I, want, "bfloat16")
        variants = {"late": (False, False, None), "early, up only": (True, False, None), "early": (True, True, None)}
        for bn in args.up_widths:
            variants[f"early, up {bn} columns"] = (True, True, ((bn, D._k_step(bn, L, "bfloat16")), down))
        for bn in args.down_widths:
            down_k = D._k_step(next_pow2(k) * bn, I, "bfloat16", 2 * D.TILE_ELEMS)
            variants[f"early, down {bn} columns"] = (True, True, (up, (bn, down_k)))
        for w in args.down_warps:
            variants[f"early, down {w} warps"] = (True, rows >= D.DOWN_EARLY_ROWS, None, w)  # as the engine ranks
        for spec in args.up_blocks:  # the second kernel as the engine runs it
            bn, bk, w = (int(v) for v in spec.split(":"))
            variants[f"early, up {bn}x{bk}, {w} warps"] = (True, rows >= D.DOWN_EARLY_ROWS, ((bn, bk), down),
                                                             D.DOWN_WARPS, w)

        rule = D.DOWN_EARLY_ROWS

        def chain(early, down_early, block, down_warps=D.DOWN_WARPS, up_warps=4):
            out, D.DOWN_EARLY_ROWS = [], 1 if down_early else 1 << 30
            warps, D.DOWN_WARPS = D.DOWN_WARPS, down_warps
            try:
                for (rw, bias, w1, w2), proj in zip(layers, projs):
                    logits = ops.call("linear", x, rw, None, out_dtype=torch.float32)
                    h = ops.call("linear", x, proj)
                    out.append(D.moe_experts_routed(h, logits, m["route"](bias), w1, w2, block=block,
                                                    up_warps=up_warps, early=early)[0])
            finally:
                D.DOWN_EARLY_ROWS, D.DOWN_WARPS = rule, warps
            return torch.cat(out)

        why = D.routed_refusal(x.new_empty(rows, L), m["route"](layers[0][1]), layers[0][2], layers[0][3])
        if why:
            print(f"{rows} rows: {why}; skipped")
            continue
        results.append(time_variants(rows, variants, lambda v: chain(*v), len(layers), args.replays, cuda, "late",
                                     "ratio"))
    return {"layers": len(layers), "early": results}


if __name__ == "__main__":
    main()
