"""One KDA layer's delta rule (``kda_pooled``) on the device against the reference, for decode and prefill steps,
with the roofline.

    python benchmarks/kda_layer.py                                   # H 16, K 128: dayzero-small's KDA layers
    python benchmarks/kda_layer.py --heads 32 --batch 1 32 128 --prefill 1x8192 8x1024 --json out.json
    python benchmarks/kda_layer.py --device cpu --small              # smoke test on a CPU

Variants: ``cuda`` (the registry's cuda implementation: fla-core's fused recurrent kernel in place by slot for
decode, its chunk kernel for prefill, when fla is installed; else the PyTorch decode step and the reference's
chunk form) and ``reference`` (the per-sequence reference), on the same bf16 inputs and fp32 state pool.
Decode roofline: the state read and written (B x H x K x V x 4 bytes, twice) plus q, k, v, g, beta, over the copy
bandwidth measured in the same run; prefill: the same bytes for the states once per sequence plus the inputs,
and the chunk form's FLOPs (about 4 x H x K x V per token for the state products, the floor of any form) over
the bf16 matmul peak measured in the run. CUDA events around each call after a warm-up call.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import ceilings, timer  # noqa: E402
from dayzero.engine.batch import ForwardBatch  # noqa: E402


def step(starts: list[int], news: list[int], H: int, K: int, device: str, seed: int = 0):
    """A step of sequences with ``starts[b]`` tokens done and ``news[b]`` new ones: its batch, the delta-rule
    inputs (bf16 q, k, v; fp32 g, beta) and a state pool with one slot per sequence after the null slot 0."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(news), sum(news)
    qs = [0]
    for n in news:
        qs.append(qs[-1] + n)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news)])
    batch = ForwardBatch(torch.zeros(T, dtype=torch.int64, device=device), pos.to(device), qs, starts,
                         [s + n for s, n in zip(starts, news)], torch.zeros(T, dtype=torch.int64, device=device),
                         torch.zeros(B, 1, dtype=torch.int64, device=device), torch.arange(1, B + 1, device=device),
                         torch.tensor(qs[1:], device=device) - 1, 16)
    r = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    q, k, v = (r(T, H, K).bfloat16() for _ in range(3))
    gate = (-torch.rand(T, H, K, generator=g) * 0.5).to(device)
    beta = torch.rand(T, H, generator=g).to(device)
    pool = r(B + 1, H, K, K) * 0.1
    return batch, (q, k, v, gate, beta), pool


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 64], help="decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens each decoding sequence has done")
    ap.add_argument("--prefill", nargs="+", default=["1x4096", "8x512"], help="SEQSxTOKENS prefill steps")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from dayzero import ops  # noqa: F401 - registers the ops
    from dayzero.ops import registry
    from dayzero.ops.kda import reference as ref

    if args.small:
        args.heads, args.head_dim, args.batch, args.prefill, args.repeats = 2, 16, [1, 3], ["1x40", "2x17"], 1
    H, K, dev = args.heads, args.head_dim, args.device
    timed = timer(dev, args.repeats)
    bw, peak = ceilings(dev, args.small)
    impl = registry.registered()["kda_pooled"].impls
    cuda = impl["cuda"].fn if "cuda" in impl else None
    print(f"{dev}: copy {bw / 1e9:.0f} GB/s, matmul {peak / 1e12:.1f} TFLOP/s; KDA H {H}, K = V {K}")
    print(f"{'step':>12} {'variant':>10} {'ms':>9} {'tok/s':>11} {'roof ms':>8} {'of roof':>8}")
    rows = []
    shapes = [("decode", [args.context] * b, [1] * b) for b in args.batch]
    for spec in args.prefill:
        seqs, tokens = map(int, spec.split("x"))
        shapes.append(("prefill", [0] * seqs, [tokens] * seqs))
    for kind, starts, news in shapes:
        batch, xs, pool = step(starts, news, H, K, dev)
        B, T = len(news), sum(news)
        state = B * H * K * K * 4 * 2
        inputs = sum(t.numel() * t.element_size() for t in xs) + T * H * K * 2  # + the output
        roof = (state + inputs) / bw if kind == "decode" else max((state + inputs) / bw, 4 * T * H * K * K / peak)
        name = f"{kind} {B}x{news[0]}"
        variants = {"reference": ref.kda_pooled}
        if cuda is not None and dev != "cpu":
            variants["cuda"] = cuda
        for v, fn in variants.items():
            ms = timed(lambda: fn(*xs, K**-0.5, pool, batch))
            rows.append(dict(step=kind, seqs=B, tokens=T, variant=v, ms=ms, tok_s=T / (ms * 1e-3), roof_ms=roof * 1e3))
            print(f"{name:>12} {v:>10} {ms:>9.3f} {T / (ms * 1e-3):>11.0f} {roof * 1e3:>8.3f} {roof * 1e3 / ms:>8.1%}")
    report = {"args": vars(args), "copy_bytes_s": bw, "matmul_flops": peak, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
