"""The ``dayzero`` command line."""
from __future__ import annotations

import argparse
import logging
import sys
import time


def _generate(args) -> int:
    from dayzero import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    t1 = time.perf_counter()
    eng = llm.engine
    print(f"model {eng.path} ({eng.model_config.model_type}, {eng.model_config.num_hidden_layers} layers) "
          f"on {eng.device} in {str(eng.dtype).removeprefix('torch.')}; cache {eng.cache_plan.capacity_tokens} tokens; "
          f"loaded in {t1 - t0:.1f}s", file=sys.stderr)
    try:
        out = llm.generate([args.prompt], params)[0].outputs[0]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t1
    print(args.prompt + out.text)
    print(f"[{len(out.token_ids)} tokens in {dt:.2f}s, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dayzero", description="Bring up and serve ultra-large sparse MoE models.")
    ap.add_argument("-v", "--verbose", action="store_true", help="log op choices and loading details")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text offline (bundled default model unless --model)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.set_defaults(func=_generate)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
