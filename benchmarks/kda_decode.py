"""One KDA layer's fused decode step (``kda_decode``'s one Triton launch: conv, gates, delta rule) replayed from a
CUDA graph, for each split of a head's state over programs, against the memory roofline.

    python benchmarks/kda_decode.py                          # H 16, K 128 (dayzero-small), batch 1 4 32 64
    python benchmarks/kda_decode.py --batch 32 128 --splits 1 2 4 --chunk-cols 128 32 --json out.json

The roofline is the bytes a step must move, the fp32 state read and written (B x H x K x K x 4 bytes, twice),
plus the projection row read, the windows read and written and the output written, over the copy bandwidth
measured in the same run. ``split`` is the value-column programs per head (``decode_kernels._splits`` picks
one per batch size), ``chunk`` the columns a program updates at a time, the next chunk loading meanwhile
(``decode_kernels.CHUNK_COLS``; a chunk of all of a program's columns is the kernel without the pipeline); ``*``
marks what the engine runs; "vs first" is against the batch's first row.

``--chain N``: the kernel as the engine runs it, behind the KDA input projection (the ``linear`` op, hidden
``--hidden`` to the projection row, weights marked as the model's, so every launch reads its first weight step
before its wait): N layers, each with weights, state and windows of its own, replayed from one CUDA graph, once
per split at ``--batch``'s first size. Prints µs a layer and what the kernel adds to the projections alone. On
the CPU (Triton's interpreter, tiny shapes) the chain runs once per split, for the tests: every split must give
the same outputs.

    python benchmarks/kda_decode.py --chain 18 --batch 1 --splits 1 2 4 8

``--proj-blocks BN:BK:WARPS ...``: the chain again with the projection launched at each of these skinny-kernel
blocks (its default is the linear op's choice): a block of fewer registers a program leaves room for
``kda_decode``'s programs to arrive, and read their state, while the projection still runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import copy_bandwidth, ms_per_replay  # noqa: E402
from dayzero.engine.batch import ForwardBatch  # noqa: E402
from dayzero.ops.kda import decode_kernels as D  # noqa: E402


def inputs(B: int, H: int, K: int, W: int, device: str, context: int = 512):
    """A decode step of B continuing sequences in slots 1..B, with dayzero-small's projection layout."""
    g = torch.Generator().manual_seed(0)
    P = H * K
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    starts = [context] * B
    batch = ForwardBatch(torch.zeros(B, dtype=torch.int64, device=device),
                         torch.full((B,), context, dtype=torch.int64, device=device), list(range(B + 1)), starts,
                         [s + 1 for s in starts], torch.zeros(B, dtype=torch.int64, device=device),
                         torch.zeros(B, 1, dtype=torch.int64, device=device), torch.arange(1, B + 1, device=device),
                         torch.arange(B, device=device), 16)
    proj = r(B, 3 * P + 2 * K + H).bfloat16().to(device)
    conv_weight = (0.5 * r(3 * P, 1, W)).bfloat16().to(device)
    conv_pool = r(B + 1, 3 * P, W - 1).bfloat16().to(device)
    gate_up = (r(2, P, K) / K**0.5).bfloat16().to(device)
    A_log, dt_bias = r(H).to(device), r(P).to(device)
    state = (0.1 * r(B + 1, H, K, K)).to(device)
    return (proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, -5.0, K**-0.5, state, batch)


def roofline_bytes(B: int, H: int, K: int, W: int) -> int:
    P = H * K
    return 2 * B * H * K * K * 4 + B * (3 * P + 2 * K + H) * 2 + 2 * B * 3 * P * (W - 1) * 2 + B * P * 2


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--conv", type=int, default=4, help="conv taps")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 32, 64])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--chunk-cols", type=int, nargs="+", default=[128, 64, 32, 16],
                    help="value columns a program updates at a time (decode_kernels.CHUNK_COLS)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--chain", type=int, default=0, help="layers of the chain behind the input projection")
    ap.add_argument("--hidden", type=int, default=2048, help="the input projection's input width (with --chain)")
    ap.add_argument("--proj-blocks", nargs="+", default=[], metavar="BN:BK:WARPS",
                    help="with --chain: the projection at these skinny-kernel blocks too (registers it leaves "
                         "kda_decode's programs)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.chain:
        return chain(args)
    if not torch.cuda.is_available():
        raise SystemExit("kda_decode.py times CUDA-graph replays: it needs a CUDA device")
    H, K, W = args.heads, args.head_dim, args.conv
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e9:,.0f} GB/s; H {H}, K {K}, conv {W}")
    print(f"{'batch':>5} {'split':>6} {'chunk':>6} {'us':>8} {'GB/s':>7} {'of copy':>8} {'vs first':>9}")
    rows, picked, picked_chunk, cols = [], D._splits, D._chunk, D.CHUNK_COLS
    for B in args.batch:
        first = None
        for nv in args.splits:
            if nv * D.MIN_COLS > K:
                continue
            for chunk in args.chunk_cols:
                if chunk > K // nv:
                    continue
                D._splits = lambda b, h, k, nv=nv: nv  # noqa: E731
                D.CHUNK_COLS = chunk
                try:
                    ms = ms_per_replay(lambda a=inputs(B, H, K, W, "cuda"): D.kda_decode(*a), args.repeats)
                finally:
                    D._splits, D.CHUNK_COLS = picked, cols
                if ms is None:
                    continue
                first = first or ms
                nbytes = roofline_bytes(B, H, K, W)
                mark = "*" if picked(B, H, K) == nv and picked_chunk(K // nv) == chunk else ""
                print(f"{B:>5} {nv:>6} {str(chunk) + mark:>6} {ms * 1e3:>8.1f} {nbytes / (ms * 1e-3) / 1e9:>7,.0f} "
                      f"{nbytes / (ms * 1e-3) / bw:>8.1%} {first / ms:>8.2f}x")
                rows.append({"batch": B, "splits": nv, "chunk_cols": chunk, "chosen": bool(mark), "us": ms * 1e3,
                             "bytes": nbytes, "of_copy": nbytes / (ms * 1e-3) / bw})
    if args.json:
        Path(args.json).write_text(json.dumps({"copy_bytes_per_s": bw, "rows": rows}, indent=1))
    return rows


def chain(args) -> list[dict]:
    """``--chain``: per projection block and split, µs a layer of the projection then the kernel, and over the
    projections alone."""
    from dayzero import ops
    from dayzero.ops.linear import kernels as LK
    from dayzero.ops.static import mark_static

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    H, K, W, B, n = args.heads, args.head_dim, args.conv, args.batch[0], args.chain
    g = torch.Generator().manual_seed(1)
    layers = []
    for _ in range(n):
        a = list(inputs(B, H, K, W, dev))
        mark_static(a[3])  # the gates' up-projections: a model weight, read before the wait
        w = mark_static((torch.randn(a[0].shape[1], args.hidden, generator=g) / args.hidden ** 0.5).bfloat16().to(dev))
        layers.append((a, w))
    x = torch.randn(B, args.hidden, generator=g).bfloat16().to(dev)
    picked = D._splits

    def project(w, block):  # block None: the linear op's choice
        if block is None:
            return ops.call("linear", x, w)
        y = x.new_empty(B, w.shape[0])
        LK.launch(x, w, y, args.hidden, block)
        return y

    def run(nv, block):  # nv None: the projections alone
        out = []
        for a, w in layers:
            a[0] = project(w, block)
            out.append(a[0][:, :K] if nv is None else D.kda_decode(*a)[0].reshape(B, -1))
        return torch.cat(out, 1)

    def timed(nv, block):
        D._splits = picked if nv is None else (lambda b, h, k: nv)
        try:
            carried = [(a[2].clone(), a[8].clone()) for a, _ in layers]  # conv windows, states
            got = run(nv, block)
            ms = ms_per_replay(lambda: run(nv, block), args.repeats) if cuda else None
            for (a, _), (win, st) in zip(layers, carried):  # every split starts from the same windows and states
                a[2].copy_(win)
                a[8].copy_(st)
            return got, None if ms is None else 1e3 * ms / n
        finally:
            D._splits = picked

    head = f"{torch.cuda.get_device_name()}" if cuda else "cpu (interpreter, untimed)"
    print(f"{head}: {n} layers of the projection ({args.hidden} -> {layers[0][0][0].shape[1]}) then kda_decode; "
          f"batch {B}, H {H}, K {K}")
    print(f"{'projection block':>17} {'alone':>7} {'split':>6} {'us a layer':>11} {'kda adds':>9} {'vs first':>9}")
    rows, very_first, first_us = [], None, None
    for spec in [None] + list(args.proj_blocks):
        block = None if spec is None else tuple(int(v) for v in spec.split(":"))
        _, alone = timed(None, block)
        name = "the op's choice" if block is None else spec
        first = None  # this block's first split
        for nv in args.splits:
            if nv * D.MIN_COLS > K:
                continue
            out, us = timed(nv, block)
            first = out if first is None else first
            very_first = out if very_first is None else very_first
            mark = "*" if picked(B, H, K) == nv else ""
            if us is not None:
                first_us = first_us or us
                print(f"{name:>17} {alone:>7.2f} {str(nv) + mark:>6} {us:>11.2f} {us - alone:>9.2f} "
                      f"{first_us / us:>8.2f}x", flush=True)
            rows.append({"batch": B, "splits": nv, "block": spec, "chosen": bool(mark), "us": us,
                         "alone": alone, "adds": None if us is None else us - alone,
                         "max_diff": (out.float() - first.float()).abs().max().item(),
                         "block_diff": (out.float() - very_first.float()).abs().max().item()})
    print(f"largest difference between splits: {max(r['max_diff'] for r in rows):.2e}; between projection blocks: "
          f"{max(r['block_diff'] for r in rows):.2e}")
    return rows

if __name__ == "__main__":
    main()
