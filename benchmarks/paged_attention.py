"""GQA attention over the paged KV pools: the Triton paged varlen kernel (``ops/attention/triton_paged.py``) for
decode, prefill and mixed steps, against the PyTorch decode path it replaced and, for one prompt, torch SDPA
over the same keys laid out contiguously (a lower bound a paged kernel can only approach).

    python benchmarks/paged_attention.py                        # H 32, Hkv 8, D 128, bf16, blocks of 16 and 64
    python benchmarks/paged_attention.py --block-size 16 --json out.json
    python benchmarks/paged_attention.py --device cpu --small   # smoke test on a CPU (Triton's interpreter)

Steps: ``decode BxC`` (B sequences of C cached tokens, one query each; ``wN``: a sliding window of N keys),
``prefill SxN`` (S fresh prompts of N tokens), ``chunk N @ C`` (N new tokens after C cached) and ``mixed``
(a 2048-token prompt with 64 decode rows). Columns: ms per call (CUDA events after a warm-up call), the KV bytes
the step must read over that time, attention FLOPs (4 x rows x keys read x H x D, causal halves included) over
that time, and the comparison's ms where there is one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import timer  # noqa: E402
from dayzero.engine.batch import ForwardBatch  # noqa: E402

CASES = [("decode", [4096] * 64, [1] * 64, None), ("decode", [8192] * 8, [1] * 8, None),
         ("decode", [1024] * 256, [1] * 256, None), ("decode", [4096] * 64, [1] * 64, 128),
         ("prefill", [0], [4096], None), ("prefill", [0] * 4, [2048] * 4, None),
         ("chunk", [3584], [512], None), ("mixed", [0] + [4096] * 64, [2048] + [1] * 64, None)]
SMALL = [("decode", [20] * 3, [1] * 3, None), ("decode", [20] * 3, [1] * 3, 5), ("prefill", [0], [40], None),
         ("mixed", [0, 9], [17, 1], None)]


def step(starts, news, bs: int, H: int, Hkv: int, D: int, device: str, seed: int = 0):
    """The batch of a step (distinct shuffled blocks per sequence), q and the key / value pools, bf16."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in zip(starts, news)]
    need = [-(-n // bs) for n in lens]
    ids = torch.randperm(sum(need), generator=g) + 1  # block 0 is the null block
    width = max(need)
    table = torch.zeros(len(lens), width, dtype=torch.int64)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = ids[at:at + k]
        at += k
    qs = [0]
    for n in news:
        qs.append(qs[-1] + n)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, news)])
    slots = torch.cat([table[b, p // bs] * bs + p % bs for b, p in
                       enumerate(torch.arange(s, s + n) for s, n in zip(starts, news))])
    T = qs[-1]
    batch = ForwardBatch(torch.zeros(T, dtype=torch.int64, device=device), pos.to(device), qs, starts, lens,
                         slots.to(device), table.to(device), torch.zeros(len(lens), dtype=torch.int64, device=device),
                         torch.tensor(qs[1:], device=device) - 1, bs)
    r = lambda *s: torch.randn(*s, generator=g).bfloat16().to(device)  # noqa: E731
    return batch, r(T, H, D), r(sum(need) + 1, bs, Hkv, D), r(sum(need) + 1, bs, Hkv, D)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke test)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from dayzero.ops.attention import cuda as attn_dev
    from dayzero.ops.attention import triton_paged

    cases = SMALL if args.small else CASES
    if args.small:
        args.heads, args.kv_heads, args.head_dim, args.block_size, args.repeats = 4, 2, 16, [4], 1
    H, Hkv, D, dev = args.heads, args.kv_heads, args.head_dim, args.device
    timed = timer(dev, args.repeats)
    scale = D**-0.5
    print(f"{dev}: H {H}, Hkv {Hkv}, D {D}, bf16")
    print(f"{'step':>28} {'bs':>4} {'rows':>6} {'triton ms':>10} {'KV GB/s':>8} {'TFLOP/s':>8} {'other':>14} "
          f"{'other ms':>9}")
    rows = []
    for bs in args.block_size:
        for kind, starts, news, window in cases:
            batch, q, k, v = step(starts, news, bs, H, Hkv, D, dev)
            why = triton_paged.refusal(q, k, v, None, window)
            if why is not None:
                print(f"  {kind}: the kernel refuses ({why})")
                continue
            fn = lambda: triton_paged.paged_attention(q, k, v, batch.block_tables, batch.cu_seqlens,  # noqa: E731
                                                      batch.positions, bs, scale, None, window)
            ms = timed(fn)
            lens = [s + n for s, n in zip(starts, news)]
            read = [min(n, window) if window else n for n in lens]
            kv_bytes = sum(read) * Hkv * D * 2 * 2
            flops = sum(4 * n * (s + (n + 1) / 2 if not window else min(window, s + n)) * H * D
                        for s, n in zip(starts, news))
            other, other_ms = "-", None
            if kind == "decode":
                other, other_ms = "torch decode", timed(
                    lambda: attn_dev.paged_attention_decode(q, k, v, batch, scale, None, window))
            elif kind == "prefill" and len(news) == 1 and dev != "cpu":
                kc = k.flatten(0, 1)[:news[0]].transpose(0, 1)[None]  # contiguous keys of one prompt, [1, Hkv, N, D]
                vc = v.flatten(0, 1)[:news[0]].transpose(0, 1)[None]
                qc = q.transpose(0, 1)[None]
                other, other_ms = "sdpa (contig)", timed(lambda: F.scaled_dot_product_attention(
                    qc, kc, vc, is_causal=True, scale=scale, enable_gqa=True))
            name = f"{kind} {len(news)}x{news[0]}" + (f" @ {starts[0]}" if starts[0] else "")
            name += f" w{window}" if window else ""
            rows.append(dict(step=name, block_size=bs, rows=q.shape[0], ms=ms, kv_gb_s=kv_bytes / ms / 1e6,
                             tflop_s=flops / ms / 1e9, other=other, other_ms=other_ms))
            om = f"{other_ms:>9.3f}" if other_ms is not None else f"{'-':>9}"
            print(f"{name:>28} {bs:>4} {q.shape[0]:>6} {ms:>10.3f} {kv_bytes / ms / 1e6:>8.0f} "
                  f"{flops / ms / 1e9:>8.1f} {other:>14} {om}")
    report = {"args": vars(args), "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
