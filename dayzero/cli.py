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


def _inspect(args) -> int:
    from dayzero.tools.inspect import main  # the tools load only for their own command

    return main(args)


def _plan(args) -> int:
    from dayzero.tools.plan import main

    return main(args)


def _ops(args) -> int:
    from dayzero.tools.ops_table import main

    return main(args)


def _profile(args) -> int:
    from dayzero.tools.profile import main

    return main(args)


def _add_tools(sub) -> None:
    model_help = "checkpoint directory or config.json (default: the bundled model)"
    kv_dtypes = ["auto", "bfloat16", "float16", "float32", "fp8", "int8"]
    i = sub.add_parser("inspect", help="structure check from config.json (and safetensors headers): layers, experts, "
                                       "parameters, weight dtypes, cache sizes")
    i.add_argument("model", nargs="?", default=None, help=model_help)
    i.add_argument("--kv-cache-dtype", default="auto", choices=kv_dtypes)
    i.add_argument("--json", action="store_true", help="one JSON object")
    i.set_defaults(func=_inspect)
    p = sub.add_parser("plan", help="memory per device and roofline speed for each TP/EP/PP/DP layout")
    p.add_argument("model", nargs="?", default=None, help=model_help)
    p.add_argument("--devices", required=True, help="NxKIND, e.g. 16xH200 (H100, H200, B200, MI300X, or --device-spec)")
    p.add_argument("--device-spec", action="append", metavar="NAME:MEM_GIB:TBPS:TFLOPS:LINK_GBPS",
                   help="describe another accelerator (link in GB/s per direction); repeatable")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--kv-cache-dtype", default="auto", choices=kv_dtypes)
    p.add_argument("--experts", default="auto", choices=["auto", "bf16", "fp8", "mxfp4"],
                   help="routed-expert storage (default: as the config declares)")
    p.add_argument("--conversion", default="bf16", choices=["bf16", "fp8", "fused"],
                   help="MXFP4 experts: the workspace they are converted into, or a fused MXFP4 GEMM")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="prefill tokens per step per DP rank")
    p.add_argument("--memory-fraction", type=float, default=0.92, help="share of device memory the plan may use")
    p.add_argument("--top", type=int, default=12, help="layouts to list")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_plan)
    o = sub.add_parser("ops", help="operator mapping table: each op the model needs and its implementation")
    o.add_argument("model", nargs="?", default=None, help=model_help)
    o.add_argument("--platform", default="cpu", help="cpu | cuda | another registered platform")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=_ops)
    f = sub.add_parser("profile", help="per-layer latency and memory for prefill and decode, by layer kind")
    f.add_argument("model", nargs="?", default=None, help=model_help + "; a bare config gets random weights")
    f.add_argument("--prompt-len", type=int, default=128)
    f.add_argument("--batch", type=int, default=1)
    f.add_argument("--steps", type=int, default=8, help="decode steps")
    f.add_argument("--repeats", type=int, default=3)
    f.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    f.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    f.add_argument("--plot", default=None, metavar="FILE.png")
    f.add_argument("--json", action="store_true")
    f.set_defaults(func=_profile)


def _serve(args) -> int:
    from dayzero.server.launcher import serve  # fastapi and uvicorn load only for this command

    return serve(args)


def _align(args) -> int:
    from dayzero.tools.align_cli import run  # the comparison code loads only for this command

    return run(args)


def _quantize(args) -> int:
    from dayzero.tools.quantize import quantize_checkpoint

    try:
        stats = quantize_checkpoint(args.src, args.dst, args.format)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.dst}: {stats['quantized']} tensors in {args.format}, {stats['copied']} copied; "
          f"{stats['bytes_before'] / 2**20:.1f} MiB -> {stats['bytes_after'] / 2**20:.1f} MiB")
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
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (bundled default model unless MODEL)")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set DAYZERO_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the checkpoint folder)")
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together")
    s.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per engine step")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-cache-blocks", type=int, default=None, help="default: sized from free memory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    s.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default 1 2 4 8 16 24 .. --max-num-seqs)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    lim = s.add_argument_group("limits (each refused with a clear error)")
    lim.add_argument("--max-body-bytes", type=int, default=4 << 20)
    lim.add_argument("--max-concurrent-requests", type=int, default=256, help="requests in the engine at once")
    lim.add_argument("--max-queue-len", type=int, default=1024, help="requests waiting for a place; more get a 429")
    lim.add_argument("--max-n", type=int, default=16)
    lim.add_argument("--max-logprobs", type=int, default=20)
    lim.add_argument("--max-stop-sequences", type=int, default=16)
    lim.add_argument("--max-stop-length", type=int, default=256, help="characters per stop sequence")
    lim.add_argument("--max-prompts", type=int, default=64, help="prompts in one completions request")
    s.set_defaults(func=_serve)
    _add_tools(sub)
    a = sub.add_parser("align", help="compare every layer with a reference; exit 1 when a layer is over threshold")
    a.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    a.add_argument("--reference", default="auto", choices=["auto", "hf", "fp32"],
                   help="hf: transformers in fp32; fp32: dayzero in fp32 on the CPU; auto: hf when transformers knows the model")
    a.add_argument("--reference-model", default=None, help="checkpoint the reference loads (default: MODEL)")
    a.add_argument("--precision", default=None, metavar="CONFIG", help="JSON file of LLM keyword arguments under test")
    a.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype under test (default: the precision config's, else bfloat16)")
    a.add_argument("--device", default=None, help="device under test (default: the precision config's, else auto)")
    a.add_argument("--prompts", default=None, metavar="FILE", help="text prompts, one a line (needs a tokenizer)")
    a.add_argument("--lengths", default="6,48,300", help="lengths of the default token-id prompts")
    a.add_argument("--threshold", type=float, default=None, help="relative error per layer (default: by dtype)")
    a.add_argument("--jump-factor", type=float, default=4.0, help="error growth over the previous layer that marks a jump")
    a.add_argument("--plot", default=None, metavar="FILE.png", help="relative error by layer, log scale")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.set_defaults(func=_align)
    q = sub.add_parser("quantize", help="copy a checkpoint with MXFP4 experts or block-FP8 linears")
    q.add_argument("src", help="checkpoint directory (bf16/fp32 experts)")
    q.add_argument("dst", help="output directory")
    q.add_argument("--format", default="mxfp4", choices=["mxfp4", "fp8"])
    q.set_defaults(func=_quantize)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
