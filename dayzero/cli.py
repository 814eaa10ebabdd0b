"""The ``dayzero`` command line (also ``python -m dayzero``).

Every command fails the same way (:mod:`dayzero.tools.cli_errors`): one ``error: ...`` line, exit status 2
for bad usage and 1 for a failure at run time, the traceback with -v / --debug. Engine options have the
names of ``LLM``'s keyword arguments (:mod:`dayzero.tools.cli_options`).
"""
from __future__ import annotations

import logging
import sys
import time

from dayzero.tools.cli_errors import run_command
from dayzero.tools.cli_options import (
    CommandParser, Parser, add_engine_options, add_global_flags, check_model, engine_kwargs,
)
from dayzero.tools.cli_tools import add_tool_commands


def _generate(args) -> int:
    from dayzero import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    t1 = time.perf_counter()
    eng = llm.engine
    print(f"model {eng.path} ({eng.model_config.model_type}, {eng.model_config.num_hidden_layers} layers) "
          f"on {eng.device} in {str(eng.dtype).removeprefix('torch.')}, {eng.num_threads} cpu threads; cache "
          f"{eng.cache_plan.capacity_tokens} tokens; loaded in {t1 - t0:.1f}s", file=sys.stderr)
    if args.token_ids:
        prompt = {"prompt_token_ids": _token_ids(args.prompt)}
    elif llm.tokenizer is None:
        raise ValueError(f"{eng.path} has no tokenizer: give the prompt as token ids with --token-ids, e.g. '1,17,42'")
    else:
        prompt = args.prompt
    out = llm.generate([prompt], params)[0].outputs[0]
    dt = time.perf_counter() - t1
    print(" ".join(map(str, out.token_ids)) if args.token_ids else args.prompt + out.text)
    print(f"[{len(out.token_ids)} tokens in {dt:.2f}s, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--token-ids: the prompt must be integers separated by commas, got {text!r}") from None


def _serve(args) -> int:
    from dayzero.server.launcher import serve  # fastapi and uvicorn load only for this command

    args.engine_config = engine_kwargs(args)  # what the launcher builds its EngineConfig from
    return serve(args)


def _quantize(args) -> int:
    from dayzero.tools.quantize import quantize_checkpoint

    stats = quantize_checkpoint(args.src, args.dst, args.format)
    print(f"{args.dst}: {stats['quantized']} tensors in {args.format}, {stats['copied']} copied; "
          f"{stats['bytes_before'] / 2**20:.1f} MiB -> {stats['bytes_after'] / 2**20:.1f} MiB")
    return 0


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text offline (bundled default model unless --model)")
    g.add_argument("prompt", help="the prompt text (token ids with --token-ids)")
    g.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    g.add_argument("--token-ids", action="store_true",
                   help="the prompt is token ids, e.g. '1,17,42', and the output too (for checkpoints without a tokenizer)")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    s.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=-1, help="-1: all tokens")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    add_engine_options(g)
    g.set_defaults(func=_generate, runs_model=True, needs_weights=True)


def _add_serve(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (bundled default model unless MODEL)")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled model)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set DAYZERO_API_KEY)")
    s.add_argument("--served-model-name", default=None, help="the model name clients use (default: the checkpoint folder)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    add_engine_options(s)
    lim = s.add_argument_group("limits (each refused with a clear error)")
    lim.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body size")
    lim.add_argument("--max-concurrent-requests", type=int, default=256, help="requests in the engine at once")
    lim.add_argument("--max-queue-len", type=int, default=1024, help="requests waiting for a place; more get a 429")
    lim.add_argument("--max-n", type=int, default=16, help="completions per request")
    lim.add_argument("--max-logprobs", type=int, default=20, help="top logprobs per token")
    lim.add_argument("--max-stop-sequences", type=int, default=16, help="stop sequences per request")
    lim.add_argument("--max-stop-length", type=int, default=256, help="characters per stop sequence")
    lim.add_argument("--max-prompts", type=int, default=64, help="prompts in one completions request")
    lim.add_argument("--max-stop-token-ids", type=int, default=64, help="stop token ids per request")
    lim.add_argument("--max-messages", type=int, default=4096, help="messages per chat request")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="characters of prompt text, checked before templating (default: what can fit the context)")
    lim.add_argument("--max-stream-backlog", type=int, default=1024,
                     help="tokens per output a client may leave unread before its request is aborted")
    lim.add_argument("--max-connections", type=int, default=2048, help="open connections; past it idle ones close first")
    lim.add_argument("--timeout-header", type=float, default=10.0, help="seconds to send a request's head")
    lim.add_argument("--timeout-body", type=float, default=60.0,
                     help="seconds to send a request's body; also the longest a response may stall unread")
    lim.add_argument("--timeout-keep-alive", type=int, default=5, help="seconds an idle keep-alive connection stays open")
    mm = s.add_argument_group("images in chat messages (data:image/...;base64 URLs; files and URLs only when allowed)")
    mm.add_argument("--limit-mm-per-prompt", type=int, default=8, metavar="N", help="images per request")
    mm.add_argument("--max-image-bytes", type=int, default=20 << 20, help="bytes of one encoded image")
    mm.add_argument("--max-image-pixels", type=int, default=64 << 20,
                    help="pixels (width x height) of one image, read from its header before decoding")
    mm.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                    help="read images from local files (file:///... or a path) inside DIR; off by default")
    mm.add_argument("--allow-remote-media", action="store_true", help="fetch http(s):// image URLs; off by default")
    mm.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds for one remote image fetch")
    s.add_argument("--allowed-origins", nargs="*", default=None, metavar="ORIGIN",
                   help="CORS origins allowed to call the API ('*' for any); off by default")
    s.set_defaults(func=_serve, runs_model=True, needs_weights=True)


def _add_quantize(sub) -> None:
    q = sub.add_parser("quantize", help="copy a checkpoint with MXFP4 experts or block-FP8 linears")
    q.add_argument("src", help="checkpoint directory (bf16/fp32 experts)")
    q.add_argument("dst", help="output directory")
    q.add_argument("--format", default="mxfp4", choices=["mxfp4", "fp8"], help="mxfp4: routed experts; fp8: linears")
    q.set_defaults(func=_quantize, runs_model=False)


def build_parser() -> Parser:
    from dayzero import __version__

    ap = Parser(prog="dayzero", description="Bring up and serve ultra-large sparse MoE models.")
    ap.add_argument("--version", action="version", version=f"dayzero {__version__}")
    add_global_flags(ap)
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=CommandParser)
    _add_generate(sub)
    _add_serve(sub)
    add_tool_commands(sub)
    _add_quantize(sub)
    from dayzero.tools.bench import add_parser as add_bench

    add_bench(sub)
    from dayzero.tools.eval_cli import add_parser as add_eval

    add_eval(sub)
    return ap


def check(args) -> None:
    """What every command checks before it loads anything: MODEL paths, and DAYZERO_OPS where ops run."""
    weights = getattr(args, "needs_weights", False) and getattr(args, "load_format", "auto") == "auto"
    if getattr(args, "model", None):
        check_model(args.model, args.command, weights)
    if getattr(args, "reference_model", None):
        check_model(args.reference_model, args.command, what="--reference-model")
    if getattr(args, "src", None):
        check_model(args.src, args.command, True, what="SRC")
    if getattr(args, "runs_model", False):
        from dayzero.ops import registry

        registry.env_overrides()


def _checked(args) -> int:
    check(args)
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a usage error already printed as one line
        return e.code if isinstance(e.code, int) else 2
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    args.verbose = args.verbose or args.debug
    return run_command(_checked, args)


if __name__ == "__main__":
    sys.exit(main())
