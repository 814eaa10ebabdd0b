"""The tool commands' options: inspect, plan, ops, profile, align. Each tool loads only for its own command."""
from __future__ import annotations

from dayzero.tools.cli_options import add_threads, device

MODEL_HELP = "checkpoint directory or config.json (default: the bundled model)"
KV_DTYPES = ["auto", "bfloat16", "float16", "float32", "fp8", "int8"]


def _inspect(args) -> int:
    from dayzero.tools.inspect import main

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


def _align(args) -> int:
    from dayzero.tools.align_cli import run

    return run(args)


def add_inspect(sub) -> None:
    i = sub.add_parser("inspect", help="structure check from config.json (and safetensors headers): layers, experts, "
                                       "parameters, weight dtypes, cache sizes; exit 1 on a header mismatch")
    i.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    i.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES, help="cache storage the sizes are for")
    i.add_argument("--json", action="store_true", help="one JSON object")
    i.set_defaults(func=_inspect, runs_model=False)


def add_plan(sub) -> None:
    from dayzero.quant.workspace import COMPUTE, FUSED_ROWS_PER_EXPERT

    p = sub.add_parser("plan", help="memory per device and roofline speed for each TP/EP/PP/DP layout; exit 1 "
                                    "when none fits")
    p.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    p.add_argument("--devices", required=True, help="NxKIND, e.g. 16xH200 (H100, H200, B200, MI300X, or --device-spec)")
    p.add_argument("--device-spec", action="append", metavar="NAME:MEM_GIB:TBPS:TFLOPS:LINK_GBPS",
                   help="describe another accelerator (link in GB/s per direction); repeatable")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default: the model's maximum)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_DTYPES, help="cache storage")
    p.add_argument("--experts", default="auto", choices=["auto", "bf16", "fp8", "mxfp4"],
                   help="routed-expert storage (auto: as the config declares)")
    p.add_argument("--conversion", default="auto", choices=list(COMPUTE),
                   help="MXFP4 experts: the workspace they are converted into, a fused MXFP4 GEMM, or per step as "
                        f"the engine's default (auto: fused for steps of at most {FUSED_ROWS_PER_EXPERT} rows per "
                        "expert)")
    p.add_argument("--fp8-activations", action="store_true",
                   help="as the engine's option: MXFP4 experts (conversion auto or fp8) converted into FP8 tiles "
                        "(one scale per 128x128) and multiplied FP8 x FP8")
    p.add_argument("--prefill-chunk", type=int, default=8192, help="prefill tokens per step per DP rank")
    p.add_argument("--memory-fraction", type=float, default=0.92, help="share of device memory the plan may use")
    p.add_argument("--top", type=int, default=12, help="layouts to list")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=_plan, runs_model=False)


def add_ops(sub) -> None:
    o = sub.add_parser("ops", help="operator mapping table: each op the model needs and its implementation")
    o.add_argument("model", nargs="?", default=None, help=MODEL_HELP)
    o.add_argument("--platform", default="cpu", help="cpu, cuda or another registered platform (the probe runs on "
                                                     "the CPU when no GPU is present)")
    add_threads(o)
    o.add_argument("--json", action="store_true", help="one JSON object")
    o.set_defaults(func=_ops, runs_model=True)


def add_profile(sub) -> None:
    f = sub.add_parser("profile", help="per-layer latency and memory for prefill and decode, by layer kind; Ctrl-C "
                                       "prints what was measured so far")
    f.add_argument("model", nargs="?", default=None, help=MODEL_HELP + "; a bare config gets random weights")
    f.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence")
    f.add_argument("--batch", type=int, default=1, help="sequences per step")
    f.add_argument("--steps", type=int, default=8, help="decode steps")
    f.add_argument("--repeats", type=int, default=3, help="measured rounds (the median is reported)")
    f.add_argument("--image", dest="images", action="append", default=None, metavar="PATH",
                   help="an image each prompt holds before its text, repeatable (qwen3_5_moe, qwen3_vl_moe): the "
                        "prefill encodes it, the vision tower timed per block")
    f.add_argument("--ep", type=int, default=1, help="group each MoE layer's routed load into this many "
                                                     "expert-parallel ranks")
    f.add_argument("--device", type=device, default="auto", help="auto (CUDA when present, else cpu), cpu, cuda, cuda:N")
    f.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="auto: bfloat16 on GPUs, float32 on the CPU")
    add_threads(f)
    f.add_argument("--plot", default=None, metavar="FILE.png", help="per-layer bars by part")
    f.add_argument("--json", action="store_true", help="one JSON object")
    f.set_defaults(func=_profile, runs_model=True)


def add_align(sub) -> None:
    a = sub.add_parser("align", help="compare every layer with a reference; exit 1 when a layer is over threshold; "
                                     "Ctrl-C compares the prompts done so far")
    a.add_argument("model", nargs="?", default=None,
                   help=MODEL_HELP + "; a bare config gets random weights, the same on both sides")
    a.add_argument("--reference", default="auto", choices=["auto", "hf", "fp32"],
                   help="hf: transformers in fp32; fp32: dayzero in fp32 on the CPU; auto: hf when transformers "
                        "knows the model")
    a.add_argument("--reference-model", default=None, help="checkpoint the reference loads (default: MODEL)")
    a.add_argument("--precision", default=None, metavar="CONFIG", help="JSON file of LLM keyword arguments under test")
    a.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype under test (default: the precision config's, else bfloat16)")
    a.add_argument("--device", type=device, default=None,
                   help="device under test (default: the precision config's, else auto)")
    add_threads(a)
    a.add_argument("--prompts", default=None, metavar="FILE", help="text prompts, one a line (needs a tokenizer)")
    a.add_argument("--lengths", default="6,48,300", help="lengths of the default token-id prompts")
    a.add_argument("--image", dest="images", action="append", default=None, metavar="PATH",
                   help="an image for the prompts, repeatable (qwen3_5_moe, qwen3_vl_moe): its tower's layers are "
                        "compared too. The default prompts each hold every image; --prompts lines take the images "
                        "in order at their placeholders (<|vision_start|><|image_pad|><|vision_end|>), or, when no "
                        "line has one, each line holds every image before its text")
    a.add_argument("--threshold", type=float, default=None, help="relative error per layer (default: by dtype)")
    a.add_argument("--jump-factor", type=float, default=4.0, help="error growth over the previous layer that marks a jump")
    a.add_argument("--plot", default=None, metavar="FILE.png", help="relative error by layer, log scale")
    a.add_argument("--json", action="store_true", help="print the result as JSON")
    a.set_defaults(func=_align, runs_model=True)


def add_tool_commands(sub) -> None:
    for add in (add_inspect, add_plan, add_ops, add_profile, add_align):
        add(sub)
