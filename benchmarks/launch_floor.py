"""What a launch boundary costs a decode step: chains of dependent kernels replayed from one CUDA graph, from
kernels that move nothing to skinny GEMVs of tens of megabytes, and the fit of a launch's time to
``t = a + bytes / b`` (a: the fixed cost of a launch after the one it depends on; b: the rate it streams at past it).

    python benchmarks/launch_floor.py                                  # sizes 256 .. 8192, one row, 24 layers
    python benchmarks/launch_floor.py --step 229:1600                  # and what the fit says of a step of 229
                                                                       # kernels moving 1,600 MB

A decode step of the hybrid at batch 1 is ~230 kernels, each needing the whole output of the one before. Two
chains measure what that costs:

- ``tick``: one program that waits for the launch before (programmatic dependent launch where the GPU has it, as
  every engine kernel does), reads one value and writes it plus one: the floor of a dependent launch, with and
  without PDL;
- ``gemv``: y = W x of one row (``--rows``) through the engine's ``linear`` op (the skinny kernel or cuBLAS, as it
  chooses), W [d, d] bf16 marked as a model weight (its first K step read before the wait) and each layer's own
  (past the L2 cache, as a step's layers are); y is the next layer's x.

Prints µs a launch and the GEMVs' read rate as a share of the copy bandwidth measured in the same run, then the
fit over the GEMVs (least squares of the relative error). With ``--step KERNELS:MB`` (a step's kernels and the
megabytes it must move, from ``benchmarks/engine_throughput.py --busy 1``: its roofline times its copy bandwidth)
it prints the step the fit predicts, ``KERNELS · a + bytes / b``, its share of the memory roofline (the bytes over
this run's copy bandwidth), and how many kernels a step could have for 60% of it at that rate. On the CPU
(Triton's interpreter, ``--sizes`` as given) each chain runs once and its result is checked against an fp32
reference, for the tests. ``--plot FILE.png`` draws the launches' times against their bytes with the fit and the
copy-bandwidth line; ``--from-json FILE`` prints and draws a run's ``--json`` again, without a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import copy_bandwidth, ms_per_replay  # noqa: E402
from dayzero import ops  # noqa: E402
from dayzero.ops.static import mark_static  # noqa: E402
from dayzero.ops.triton_support import HAS_TRITON, grid_dependency, pdl  # noqa: E402

TARGET = 0.6  # the share of the roofline the step is asked for

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tick_kernel(x_ptr, y_ptr, PDL: tl.constexpr):
        grid_dependency(PDL)
        tl.store(y_ptr, tl.load(x_ptr) + 1.0)


def tick_chain(xs: list[torch.Tensor], use_pdl: bool) -> torch.Tensor:
    """xs[i + 1][0] = xs[i][0] + 1, one launch each; returns the last."""
    options = pdl(xs[0]) if use_pdl else {"PDL": False}
    for a, b in zip(xs, xs[1:]):
        _tick_kernel[(1,)](a, b, **options)
    return xs[-1]


def gemv_chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    for w in weights:
        x = ops.call("linear", x, w)
    return x


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(a µs, b bytes/µs) of the line ``us = a + bytes / b`` through (bytes, us) points, least squares of the
    relative error (each point weighted by 1 / us²): a step's launches are mostly small and mid-sized, and a plain
    fit would follow the few largest."""
    if len({p[0] for p in points}) < 2:
        raise ValueError("the fit needs points of at least two sizes")
    w = [1.0 / p[1] ** 2 for p in points]
    total = sum(w)
    mx = sum(wi * p[0] for wi, p in zip(w, points)) / total
    my = sum(wi * p[1] for wi, p in zip(w, points)) / total
    slope = (sum(wi * (p[0] - mx) * (p[1] - my) for wi, p in zip(w, points))
             / sum(wi * (p[0] - mx) ** 2 for wi, p in zip(w, points)))
    if slope <= 0:
        raise ValueError("time does not grow with bytes: no rate to fit")
    return my - slope * mx, 1.0 / slope


def step_model(kernels: int, nbytes: float, bandwidth: float, a_us: float, b: float) -> dict:
    """What the fit says of a step of ``kernels`` launches moving ``nbytes``, against its roofline at
    ``bandwidth`` (bytes/s): its time, its share of the roofline and the kernels a step could have for
    :data:`TARGET` of it."""
    roofline_ms = 1e3 * nbytes / bandwidth
    stream_us = nbytes / b
    step_us = kernels * a_us + stream_us
    budget_us = 1e3 * roofline_ms / TARGET - stream_us
    return dict(kernels=kernels, roofline_ms=roofline_ms, bytes=nbytes, step_us=step_us,
                of_roofline=1e3 * roofline_ms / step_us, fixed_us=kernels * a_us, stream_us=stream_us,
                kernels_for_target=max(0, int(budget_us // a_us)) if a_us > 0 else None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192],
                    help="d of each GEMV chain's W [d, d]")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--step", default=None, metavar="KERNELS:MB")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="FILE.png")
    ap.add_argument("--from-json", default=None, metavar="FILE", help="a run's --json: print and plot it again")
    args = ap.parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        print_table(result)
        if args.plot:
            plot(result, args.plot)
        return result
    if not HAS_TRITON:
        raise SystemExit("needs Triton (on the CPU with TRITON_INTERPRET=1)")
    step = None
    if args.step:
        try:
            kernels, mb = args.step.split(":")
            step = (int(kernels), float(mb) * 1e6)
        except ValueError:
            raise SystemExit(f"--step {args.step!r}: expected KERNELS:MB, e.g. 229:1600") from None
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bandwidth = copy_bandwidth(dev) if cuda else None
    g = torch.Generator().manual_seed(0)
    rows = []

    xs = [torch.zeros(1, device=dev) for _ in range(args.layers + 1)]
    for use_pdl in (True, False):
        name = "tick" + ("" if use_pdl else ", no PDL")
        out = tick_chain(xs, use_pdl).item()
        ms = ms_per_replay(lambda: tick_chain(xs, use_pdl), args.replays) if cuda else None
        rows.append(dict(chain=name, d=0, bytes=0, us=None if ms is None else 1e3 * ms / args.layers,
                         ok=out == float(args.layers)))

    for d in args.sizes:
        weights = [mark_static((torch.randn(d, d, generator=g) / d ** 0.5).to(dev, dt)) for _ in range(args.layers)]
        x = torch.randn(args.rows, d, generator=g).to(dev, dt)
        ref = x.float()
        for w in weights:
            ref = (ref @ w.float().t()).to(dt).float()
        got = gemv_chain(x, weights).float()
        ms = ms_per_replay(lambda: gemv_chain(x, weights), args.replays) if cuda else None
        err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
        rows.append(dict(chain="gemv", d=d, bytes=d * d * weights[0].element_size(),
                         us=None if ms is None else 1e3 * ms / args.layers, ok=err < 5e-2, err=err))
        del weights

    result = dict(device=torch.cuda.get_device_name() if cuda else "cpu", bandwidth=bandwidth, rows=rows,
                  layers=args.layers, batch_rows=args.rows)
    timed = [(r["bytes"], r["us"]) for r in rows if r["chain"] == "gemv" and r["us"] is not None]
    if len({p[0] for p in timed}) >= 2:
        a_us, b = fit(timed)
        result["fit"] = dict(a_us=a_us, bytes_per_us=b)
        if step:
            result["step"] = step_model(*step, bandwidth, a_us, b)
    elif step:
        print("--step: no timings to fit (no GPU)")
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return result


def plot(r: dict, path: str) -> None:
    """µs a launch against its megabytes (log-log): the GEMVs, the ticks' floor, the fit and the copy bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gemv = [(row["bytes"] / 1e6, row["us"]) for row in r["rows"] if row["chain"] == "gemv" and row["us"]]
    if not gemv:
        raise SystemExit("--plot: no timings to draw (no GPU)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(*zip(*gemv), "o", label=f"skinny GEMV of {r['batch_rows']} row(s), the engine's linear op")
    lo, hi = min(m for m, _ in gemv) / 2, max(m for m, _ in gemv) * 2  # the lines' span, past the points
    mb = [lo * 1.25 ** i for i in range(math.ceil(math.log(hi / lo, 1.25)) + 1)]
    if "fit" in r:
        a_us, b = r["fit"]["a_us"], r["fit"]["bytes_per_us"]
        ax.plot(mb, [a_us + m * 1e6 / b for m in mb], "-", label=f"fit: {a_us:.2f} us + bytes / "
                f"{b * 1e6 / 1e9:.0f} GB/s")
    if r["bandwidth"]:
        ax.plot(mb, [m * 1e6 / r["bandwidth"] * 1e6 for m in mb], "--",
                label=f"bytes / copy bandwidth ({r['bandwidth'] / 1e9:.0f} GB/s)")
    for row, style in zip((row for row in r["rows"] if row["chain"].startswith("tick") and row["us"]), (":", "-.")):
        ax.axhline(row["us"], linestyle=style, color="gray", label=f"{row['chain']}: {row['us']:.2f} us")
    ax.set(xscale="log", yscale="log", xlabel="MB a launch reads", ylabel="us a launch",
           title=f"{r['device']}\n{r['layers']} dependent launches a chain, replayed from a CUDA graph")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def print_table(r: dict) -> None:
    bw = r["bandwidth"]
    print(f"{r['device']}; copy bandwidth {bw / 1e9:.0f} GB/s" if bw else f"{r['device']} (Triton's interpreter: "
          f"no timings)")
    print(f"{r['layers']} dependent launches a chain, {r['batch_rows']} row(s), replayed from one CUDA graph")
    print(f"{'chain':<14} {'W':>11} {'MB':>8} {'us a launch':>12} {'GB/s':>7} {'of copy':>8}  result")
    for row in r["rows"]:
        us = row["us"]
        rate = row["bytes"] / (us * 1e-6) if us and row["bytes"] else None
        shape = f"{row['d']} x {row['d']}" if row["d"] else "-"
        check = "ok" if row["ok"] else "WRONG"
        if "err" in row:
            check += f" ({row['err']:.1e} of the fp32 reference's largest)"
        print(f"{row['chain']:<14} {shape:>11} {row['bytes'] / 1e6:>8.2f} {f'{us:.2f}' if us else '-':>12} "
              f"{f'{rate / 1e9:.0f}' if rate else '-':>7} {f'{rate / bw:.0%}' if rate and bw else '-':>8}  {check}")
    if "fit" in r:
        a_us, b = r["fit"]["a_us"], r["fit"]["bytes_per_us"]
        print(f"fit over the GEMVs (relative error): t = {a_us:.2f} us + bytes / {b * 1e6 / 1e9:.0f} GB/s "
              f"({b * 1e6 / bw:.0%} of copy)")
    if "step" in r:
        s = r["step"]
        print(f"a step of {s['kernels']} kernels moving {s['bytes'] / 1e6:.0f} MB (roofline {s['roofline_ms']:.3f} ms):"
              f" {s['fixed_us']:.0f} us fixed + {s['stream_us']:.0f} us streaming = {s['step_us']:.0f} us, "
              f"{s['of_roofline']:.1%} of the roofline; {TARGET:.0%} of it leaves room for "
              f"{s['kernels_for_target']} kernels at this rate")


if __name__ == "__main__":
    main()
