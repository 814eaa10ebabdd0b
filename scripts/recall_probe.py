"""Which layers answer a checkpoint's recall prompts, by context length (:mod:`dayzero.train.probe`): the first
digit's accuracy as is and with the attention layers' outputs zeroed over the question, and where each attention
layer's weight goes at the answer's first position.

    python scripts/recall_probe.py dayzero/assets/default --contexts 256 512 1024 2048 --n 20 --plot probe.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from dayzero.eval.tasks import RECALL_STYLES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=str(ROOT / "dayzero" / "assets" / "default"),
                    help="checkpoint directory (default: the bundled model)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 2048], metavar="L",
                    help="recall prompts' lengths in tokens")
    ap.add_argument("--n", type=int, default=20, help="prompts per length")
    ap.add_argument("--recall-style", default=None, choices=RECALL_STYLES,
                    help="how the pairs are written (default: the style the model's card records it learnt, else "
                         "letter)")
    ap.add_argument("--sparse", action="store_true",
                    help="the DSA layers attend over their indexers' top-k, as the engine does (default: densely)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plot", default=None, metavar="FILE", help="write the two curves as a PNG")
    args = ap.parse_args(argv)
    if args.n < 1 or any(c < 64 for c in args.contexts):
        ap.error("--n must be at least 1 and every context at least 64 tokens")

    import torch
    from tqdm import tqdm

    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.train.card import trained_recall_style
    from dayzero.train.checkpoint import load_model
    from dayzero.train.probe import plot, probe_recall, table

    if args.recall_style is None:
        args.recall_style = trained_recall_style(args.model)

    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        ap.error(f"{args.model} has no tokenizer files")
    model = load_model(args.model, torch.device(args.device)).eval()
    probes = [probe_recall(model, tokenizer, c, args.n, args.recall_style, sparse=args.sparse)
              for c in tqdm(args.contexts, desc="recall probe", unit="length", file=sys.stderr)]
    print(f"{Path(args.model).name}: recall ({args.recall_style}) through the training forward, "
          f"{'sparse' if args.sparse else 'dense'} attention")
    print(table(probes))
    if args.plot:
        plot(probes, args.plot, title=f"{Path(args.model).name}: which layers recall")
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
