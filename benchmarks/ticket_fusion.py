"""Two dependent GEMVs of a decode step's few rows, h = W1 x then y = W2 h, as two launches or as one launch whose
programs take their items by ticket, side by side in one run: what a launch boundary between dependent kernels
costs, and what a launch that pipelines them saves.

    python benchmarks/ticket_fusion.py                                  # dayzero-small-like shapes, rows 1 4
    python benchmarks/ticket_fusion.py --shapes 2048:512:2048 --rows 1 --layers 24 --block 4:1024 --warps 4

A decode step of the hybrid is ~230 kernels, most of them a skinny GEMV that depends on the whole output of the
one before; with programmatic dependent launch each kernel is scheduled while the one before runs and reads its
first weight step before it waits, but it still waits for that kernel's last program to end. Merging two such
kernels into one launch needs the second's programs to wait for the first's inside the launch. Here each program
takes a ticket from a counter (the order programs start in): tickets below the first GEMV's item count compute a
block of h's columns and then count themselves done; the others read their first weight step, wait until every
first-GEMV item is done (an acquire of that counter) and compute a block of y. A program waits only on items of
smaller tickets, which programs that already run hold, so the launch finishes whatever the residency; the last
program to finish zeroes the counters for the next replay.

``--groups G``: y's columns of group g read only h's columns of group g (W2 block-diagonal, as each KDA head reads
its own rows of the input projection): a second-GEMV item waits only for its group's first-GEMV items.

Variants: ``two launches`` (the same kernel once per GEMV, each launch with programmatic dependent launch where
the GPU has it), ``two launches, no PDL``, ``one launch, tickets`` (every first-GEMV item's ticket before the
second's) and ``one launch, tickets by group`` (group by group: each group's second-GEMV items start while the
next group's first-GEMV items still run; the same as the one before at one group), ``one launch, light tickets``
(relaxed atomics for the tickets and the count of programs done, the wait polled by plain loads and one acquire
once met, where the variants before poll with acquiring atomics that contend with the counts they wait for) and
``one launch, light, by id`` (the same without tickets: items by program id, which assumes the hardware starts a
1-D grid's programs in id order, as it does but does not promise); at one group also ``two
launches, the linear op's`` (the engine's skinny kernel at the same blocks, so that what this kernel shows
carries over to it). Each layer has weights of its
own (past the L2 cache, as a step's layers are) and its y is the next layer's x (so ``K`` = ``N2``). On a GPU the
chain of ``--layers`` layers is replayed from one CUDA graph; prints µs a layer, the ratio against two launches
and the weights' read rate, also as a share of the copy bandwidth measured in the same run (the roofline of a
GEMV of few rows). On the CPU (Triton's interpreter, tiny shapes, for the tests) each variant runs once and the
largest difference between them and from an fp32 reference is printed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import copy_bandwidth, ms_per_replay  # noqa: E402
from dayzero.ops.linear import kernels as LK  # noqa: E402
from dayzero.ops.static import mark_static  # noqa: E402
from dayzero.ops.triton_support import HAS_TRITON, grid_dependency, pdl  # noqa: E402

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _x_rows(x_ptr, s_xm, m, m_ok, k, k_ok, CG: tl.constexpr):
        """x[m, k] in fp32; ``CG``: read past the SM's L1 (rows other programs of this launch wrote)."""
        if CG:
            x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0,
                        cache_modifier=".cg")
        else:
            x = tl.load(x_ptr + m[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _weight_tile(w_ptr, n, n_ok, k0, KW: tl.constexpr, BK: tl.constexpr):
        """W[n, k0:k0+BK] in fp32 (rows of KW columns)."""
        k = k0 + tl.arange(0, BK)
        return tl.load(w_ptr + n[:, None] * KW + k[None, :], mask=n_ok[:, None] & (k[None, :] < KW),
                       other=0.0).to(tl.float32)

    @triton.jit
    def _gemv_rows(x_ptr, s_xm, w_ptr, w_first, n, n_ok, m, m_ok, KW: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, CG: tl.constexpr):
        """x[m, :] · W[n, :]ᵀ over all of KW [BM, BN] fp32, the first K step's weight tile ``w_first`` read
        already."""
        k = tl.arange(0, BK)
        acc = tl.sum(_x_rows(x_ptr, s_xm, m, m_ok, k, k < KW, CG)[:, None, :] * w_first[None, :, :], axis=2)
        for k0 in range(BK, KW, BK):
            k = k0 + tl.arange(0, BK)
            w = _weight_tile(w_ptr, n, n_ok, k0, KW, BK)
            acc += tl.sum(_x_rows(x_ptr, s_xm, m, m_ok, k, k < KW, CG)[:, None, :] * w[None, :, :], axis=2)
        return acc

    @triton.jit
    def _item(t, NA: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, BY_GROUP: tl.constexpr):
        """(is a first-GEMV item, its index among its GEMV's items, its group) of ticket ``t``: all first-GEMV
        items before the second's, or (``BY_GROUP``) group by group, each group's first-GEMV items then its
        second's."""
        if BY_GROUP:
            per = NA // G + NB // G
            g = t // per
            r = t - g * per
            first = r < NA // G
            index = tl.where(first, g * (NA // G) + r, g * (NB // G) + r - NA // G)
        else:
            first = t < NA
            index = tl.where(first, t, t - NA)
            g = tl.where(first, index // (NA // G), index // (NB // G))
        return first, index, g

    @triton.jit
    def _pair_kernel(x_ptr, w1_ptr, h_ptr, w2_ptr, y_ptr, tick_ptr, M, K: tl.constexpr, N1: tl.constexpr,
                     N2: tl.constexpr, G: tl.constexpr, PHASE: tl.constexpr, BY_GROUP: tl.constexpr,
                     BM: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr, BN2: tl.constexpr, BK2: tl.constexpr,
                     PDL: tl.constexpr, LIGHT: tl.constexpr = False, ORDER: tl.constexpr = False):
        # x [M, K], w1 [N1, K], h [M, N1], w2 [N2, N1 / G] (y's columns of group g read h's of group g only),
        # y [M, N2]; tick: int32 [G + 2] (tickets taken, each group's first-GEMV items done, programs done), zero
        # between launches. PHASE 0: both GEMVs (grid NA + NB, items by ticket); 1: the first (grid NA); 2: the
        # second (grid NB).
        NA = N1 // BN1
        NB = N2 // BN2
        HG = N1 // G  # h's columns a group
        # LIGHT: relaxed atomics for the tickets and the programs done, the wait polled by plain loads and one
        # acquire once it is met; ORDER (with LIGHT): items by program id, no ticket (assumes programs start in
        # id order, as the hardware dispatches a 1-D grid; not guaranteed).
        if PHASE == 0 and ORDER:
            t = tl.program_id(0)
        elif PHASE == 0 and LIGHT:
            t = tl.atomic_add(tick_ptr, 1, sem="relaxed")
        elif PHASE == 0:
            t = tl.atomic_add(tick_ptr, 1)  # the order this program started in among the launch's
        elif PHASE == 1:
            t = tl.program_id(0)
        else:
            t = tl.program_id(0) + NA
        first, index, g = _item(t, NA, NB, G, BY_GROUP)
        m = tl.arange(0, BM)
        m_ok = m < M
        if first:  # a block of h's columns
            # (names of their own in each branch: Triton merges a name both branches assign, and the tiles'
            # shapes differ)
            n1 = index * BN1 + tl.arange(0, BN1)
            n1_ok = n1 < N1
            w1_first = _weight_tile(w1_ptr, n1, n1_ok, 0, K, BK1)  # a model weight: read before the wait
            grid_dependency(PDL)
            h = _gemv_rows(x_ptr, K, w1_ptr, w1_first, n1, n1_ok, m, m_ok, K, BM, BN1, BK1, False)
            tl.store(h_ptr + m[:, None] * N1 + n1[None, :], h.to(h_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n1_ok[None, :])
            if PHASE == 0:
                tl.debug_barrier()  # every thread's h stored before the program's one release
                tl.atomic_add(tick_ptr + 1 + g, 1, sem="release")
        else:  # a block of y's columns, once its group's columns of h are written
            n2 = index * BN2 + tl.arange(0, BN2)
            n2_ok = n2 < N2
            w2_first = _weight_tile(w2_ptr, n2, n2_ok, 0, HG, BK2)
            grid_dependency(PDL)
            if PHASE == 0 and LIGHT:
                seen = tl.load(tick_ptr + 1 + g, volatile=True)
                while seen < NA // G:
                    seen = tl.load(tick_ptr + 1 + g, volatile=True)
                tl.atomic_add(tick_ptr + 1 + g, 0, sem="acquire")  # the items' h visible from here
                tl.debug_barrier()
            elif PHASE == 0:
                seen = tl.atomic_add(tick_ptr + 1 + g, 0, sem="acquire")
                while seen < NA // G:
                    seen = tl.atomic_add(tick_ptr + 1 + g, 0, sem="acquire")
                tl.debug_barrier()
            y = _gemv_rows(h_ptr + g * HG, N1, w2_ptr, w2_first, n2, n2_ok, m, m_ok, HG, BM, BN2, BK2, PHASE == 0)
            tl.store(y_ptr + m[:, None] * N2 + n2[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n2_ok[None, :])
        if PHASE == 0:
            tl.debug_barrier()
            if LIGHT:  # the counters' last use in this launch is before each program's count: no ordering needed
                done = tl.atomic_add(tick_ptr + 1 + G, 1, sem="relaxed")
            else:
                done = tl.atomic_add(tick_ptr + 1 + G, 1, sem="acq_rel")
            if done == NA + NB - 1:  # the last program: every ticket taken, every item done
                for i in range(0, G + 2):
                    tl.atomic_xchg(tick_ptr + i, 0)


VARIANTS = ("two launches", "two launches, no PDL", "one launch, tickets", "one launch, tickets by group",
            "one launch, light tickets", "one launch, light, by id")
LINEAR = "two launches, the linear op's"  # the engine's skinny kernel at the same blocks (one group only)


def pair(variant: str, x, w1, h, w2, y, tick, block, warps: int, groups: int) -> torch.Tensor:
    """y = W2 (W1 x) through ``variant``'s launches (h: the scratch between them; ``groups``: y's columns of group
    g read h's of group g, w2 [N2, N1 / groups])."""
    (M, K), N1, N2 = x.shape, w1.shape[0], w2.shape[0]
    (bn1, bk1), (bn2, bk2) = block
    if variant == LINEAR:
        LK.launch(x, w1, h, K, (bn1, min(bk1, triton.next_power_of_2(K)), warps))
        LK.launch(h, w2, y, N1, (bn2, min(bk2, triton.next_power_of_2(N1)), warps))
        return y
    na, nb = N1 // bn1, N2 // bn2
    options = {"PDL": False} if variant.endswith("no PDL") else pdl(x)
    consts = dict(K=K, N1=N1, N2=N2, G=groups, BY_GROUP=variant.endswith("by group"), BM=triton.next_power_of_2(M),
                  BN1=bn1, BK1=min(bk1, triton.next_power_of_2(K)), BN2=bn2,
                  BK2=min(bk2, triton.next_power_of_2(N1 // groups)), num_warps=warps, **options)
    args = (x, w1, h, w2, y, tick, M)
    if variant.startswith("one launch"):
        _pair_kernel[(na + nb,)](*args, PHASE=0, LIGHT="light" in variant, ORDER=variant.endswith("by id"),
                                 **consts)
    else:
        _pair_kernel[(na,)](*args, PHASE=1, **consts)
        _pair_kernel[(nb,)](*args, PHASE=2, **consts)
    return y


def parse_block(spec: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``BN:BK`` (both GEMVs) or ``BN1:BK1:BN2:BK2``."""
    v = [int(p) for p in spec.split(":")]
    if len(v) not in (2, 4) or min(v) < 1:
        raise SystemExit(f"--block {spec!r}: expected BN:BK or BN1:BK1:BN2:BK2 of positive ints")
    return ((v[0], v[1]), (v[0], v[1])) if len(v) == 2 else ((v[0], v[1]), (v[2], v[3]))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["2048:512:2048", "2048:2048:2048"], metavar="K:N1:N2",
                    help="x [rows, K] -> h [rows, N1] -> y [rows, N2]; N2 = K (y feeds the next layer)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--block", default="4:1024", metavar="BN:BK[:BN2:BK2]", help="columns and K step a program")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--groups", type=int, default=1, help="y's columns of group g read h's of group g only (a "
                                                          "per-head consumer, as KDA's heads read their projection "
                                                          "rows)")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not HAS_TRITON:
        raise SystemExit("needs Triton (on the CPU with TRITON_INTERPRET=1)")
    block = parse_block(args.block)
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth(dev) if cuda else None
    out = []
    for spec in args.shapes:
        K, N1, N2 = (int(v) for v in spec.split(":"))
        if N2 != K:
            raise SystemExit(f"--shapes {spec}: N2 must equal K (each layer's y is the next layer's x)")
        G, ((bn1, _), (bn2, _)) = args.groups, block
        if N1 % (G * bn1) or N2 % (G * bn2):
            raise SystemExit(f"--shapes {spec} --groups {G} --block {args.block}: each group's columns of h and y "
                             f"must be whole blocks ({N1} / {G} by {bn1}, {N2} / {G} by {bn2})")
        g = torch.Generator().manual_seed(0)
        # model weights (mark_static): the linear op's kernel reads their first K step before its wait, as ours do
        w1s = [mark_static((torch.randn(N1, K, generator=g) / K**0.5).to(dev, dt)) for _ in range(args.layers)]
        w2s = [mark_static((torch.randn(N2, N1 // G, generator=g) / (N1 // G)**0.5).to(dev, dt))
               for _ in range(args.layers)]
        variants = VARIANTS + ((LINEAR,) if G == 1 else ())
        weight_bytes = sum(w.numel() * w.element_size() for w in w1s + w2s) / args.layers
        for M in args.rows:
            x0 = torch.randn(M, K, generator=g).to(dev, dt)
            ref = x0.float()
            for w1, w2 in zip(w1s, w2s):
                h = (ref @ w1.float().t()).to(dt).float().view(M, G, N1 // G)
                ref = torch.einsum("mgi,goi->mgo", h, w2.float().view(G, N2 // G, N1 // G)).reshape(M, N2)
            hs = [torch.empty(M, N1, device=dev, dtype=dt) for _ in range(args.layers)]
            ys = [torch.empty(M, N2, device=dev, dtype=dt) for _ in range(args.layers)]
            ticks = [torch.zeros(G + 2, dtype=torch.int32, device=dev) for _ in range(args.layers)]

            def chain(variant):
                x = x0
                for layer in range(args.layers):
                    x = pair(variant, x, w1s[layer], hs[layer], w2s[layer], ys[layer], ticks[layer], block,
                             args.warps, G)
                return x

            results, times = {}, {}
            for variant in variants:
                results[variant] = chain(variant).float().clone()
                if cuda:
                    ms = ms_per_replay(lambda: chain(variant), args.replays)
                    times[variant] = None if ms is None else ms * 1e3 / args.layers
            first = results[VARIANTS[0]]
            row = dict(shape=spec, rows=M, layers=args.layers, block=block, warps=args.warps, groups=G,
                       us_a_layer=times, weight_bytes=weight_bytes,
                       max_diff=max((results[v] - first).abs().max().item() for v in VARIANTS),
                       linear_diff=(results[LINEAR] - first).abs().max().item() if G == 1 else None,
                       ref_diff=((first - ref).abs().max() / ref.abs().max()).item(),
                       counters_zero=all(int(t.abs().sum()) == 0 for t in ticks))
            out.append(row)
    print_table(out, bandwidth, cuda)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


def print_table(rows: list[dict], bandwidth: float | None, cuda: bool) -> None:
    dev = torch.cuda.get_device_name() if cuda else "cpu (Triton's interpreter: no timings)"
    print(f"{dev}; copy bandwidth {bandwidth / 1e9:.0f} GB/s" if bandwidth else dev)
    print(f"{'K:N1:N2':>16} {'rows':>4}  {'variant':<29} {'us a layer':>10} {'vs two':>7} {'weights GB/s':>12} "
          f"{'of copy':>7}")
    for r in rows:
        base = r["us_a_layer"].get(VARIANTS[0])
        for variant in VARIANTS + ((LINEAR,) if r["linear_diff"] is not None else ()):
            us = r["us_a_layer"].get(variant)
            ratio = f"{base / us:.2f}x" if us and base else "-"
            rate = r["weight_bytes"] / (us * 1e-6) if us else None
            print(f"{r['shape']:>16} {r['rows']:>4}  {variant:<29} {f'{us:.2f}' if us else '-':>10} {ratio:>7} "
                  f"{f'{rate / 1e9:.0f}' if rate else '-':>12} {f'{rate / bandwidth:.0%}' if rate else '-':>7}")
        linear = "" if r["linear_diff"] is None else f", the linear op's from them {r['linear_diff']:.2e}"
        print(f"{'':>16} {'':>4}  largest difference between the variants {r['max_diff']:.2e}{linear}, from the fp32 "
              f"reference {r['ref_diff']:.2e} (of its largest); counters zero after: {r['counters_zero']}")


if __name__ == "__main__":
    main()
