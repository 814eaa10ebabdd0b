"""Detokenization cost per engine step: the running text of every sequence, decoded whole at each step (what the
engine did before) vs incrementally (``dayzero.engine.detokenizer``), as outputs grow.

    python benchmarks/detokenize.py --seqs 64 --lengths 256 1024 4096

Token ids are drawn from the encoding of a multilingual text with the bundled tokenizer (byte-level) or the
one in ``--tokenizer DIR``. For each output length L it times the step that appends token L to every one of
``--seqs`` sequences: the whole decode of L tokens per sequence against one incremental update each.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

import dayzero
from dayzero.engine.detokenizer import IncrementalText
from dayzero.engine.tokenizer import load_tokenizer

TEXT = "Grüße aus Zürich — 東京の天気は晴れ, naïve café. Numbers 3.14159 and the quick brown fox. " * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(Path(dayzero.__file__).parent / "assets" / "default"))
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(args.tokenizer)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    base = tok.encode(TEXT, add_special_tokens=False)
    g = torch.Generator().manual_seed(0)
    print(f"{'length':>7} {'whole decode ms/step':>21} {'incremental ms/step':>20} {'ratio':>8}")
    for L in args.lengths:
        outs = [[base[i] for i in torch.randint(0, len(base), (L,), generator=g).tolist()] for _ in range(args.seqs)]
        incs = []
        for ids in outs:  # bring each running text up to L-1 tokens, as the engine has by then
            inc = IncrementalText(decode)
            for n in range(max(1, L - 64), L):
                inc.update(ids[:n])
            incs.append(inc)
        t = time.perf_counter()
        for _ in range(args.repeats):
            for ids in outs:
                decode(ids)
        whole = (time.perf_counter() - t) / args.repeats
        t = time.perf_counter()
        for ids, inc in zip(outs, incs):  # one step: token L arrives for every sequence
            inc.update(ids)
        step = time.perf_counter() - t
        print(f"{L:>7} {1e3 * whole:>21.2f} {1e3 * step:>20.3f} {whole / step:>7.0f}x")


if __name__ == "__main__":
    main()
