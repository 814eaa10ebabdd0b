"""What the commands share: the parser (one-line usage errors, defaults in every help), the global flags,
argument types, the engine options (named as ``EngineConfig`` and ``LLM`` name them) and the MODEL check."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

MODEL_FORMS = "a checkpoint directory (config.json and *.safetensors) or a config.json file"
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


class Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default, except where there is none to show (None, off) or the help already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        d = action.default
        if d is None or d is False or d is argparse.SUPPRESS or (isinstance(d, tuple) and not d) or "(default" in h:
            return h
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """Usage errors are one line, ``error: ...``, with exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def add_global_flags(p: argparse.ArgumentParser, default=False) -> None:
    """-v / --debug. The top-level parser holds the defaults; each command's parser takes the same flags with
    ``default=SUPPRESS``, so they work after the command too without resetting a flag given before it."""
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="log loading details and op choices; show the traceback of an error")
    p.add_argument("--debug", action="store_true", default=default, help="-v with debug logging")


class CommandParser(Parser):
    """A command's parser: the global flags are accepted here as well as before the command."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        add_global_flags(self, argparse.SUPPRESS)


# --- argument types ------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def port(text: str) -> int:
    v = positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1..65535), got {text!r}")
    return v


def byte_size(text: str) -> int:
    """Bytes, with an optional unit: 1073741824, 8GiB, 512MiB, 2.5GB."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if m is None or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise argparse.ArgumentTypeError(f"must be a positive size like 8GiB, 512MiB or 1073741824, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def device(text: str) -> str:
    """A device of this machine: auto, cpu, cuda, cuda:N (one that is not there is refused, naming what is)."""
    from dayzero.engine.device import resolve_device

    try:
        resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_threads(p) -> None:
    p.add_argument("--threads", "--num-threads", dest="num_threads", type=positive_int, default=None, metavar="N",
                   help="CPU threads for torch (default: torch's count, or the cores other processes leave free "
                        "when they load the machine; logged with -v)")


# --- the engine's options ------------------------------------------------------------------------------
def add_engine_options(p) -> None:
    """Every ``EngineConfig`` field but ``model``, as ``--field-name`` (``--threads`` for ``num_threads``)."""
    from dayzero.cache.quant import KV_CACHE_DTYPES
    from dayzero.config.model_config import DTYPES
    from dayzero.cache.planner import SPARE_SNAPSHOTS_PER_SEAT
    from dayzero.cache.eviction import POLICIES as EVICTION_POLICIES
    from dayzero.quant.workspace import COMPUTE, FUSED_ROWS_PER_EXPERT

    e = p.add_argument_group("engine (the LLM(...) keyword arguments of the same names)")
    e.add_argument("--device", type=device, default="auto", help="auto (CUDA when present, else cpu), cpu, cuda, cuda:N")
    e.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="auto: bfloat16 on GPUs, float32 on the CPU")
    add_threads(e)
    e.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights from the config alone (MODEL may then be a config.json)")
    e.add_argument("--seed", type=int, default=0, help="random seed (dummy weights, sampling)")
    e.add_argument("--max-num-seqs", type=int, default=64, metavar="N", help="sequences decoded together")
    e.add_argument("--max-model-len", type=int, default=None, metavar="L", help="context length (default: the model's)")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="tokens per engine step, and so the prefill chunk")
    e.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per cache block (default: 16, or the stride of compressed rows when larger, e.g. 128 "
                        "for DeepSeek-V4)")
    e.add_argument("--num-cache-blocks", type=int, default=None, metavar="N",
                   help="cache blocks (default: as many as the cache memory holds)")
    e.add_argument("--cache-memory-bytes", type=byte_size, default=None, metavar="SIZE",
                   help="cache budget, e.g. 8GiB (default: --cache-memory-fraction of free memory)")
    e.add_argument("--cache-memory-fraction", type=float, default=0.5, metavar="F",
                   help="share of free memory for the cache when no budget is given")
    e.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="paged cache storage; fp8 / int8 quantise it (auto: the model dtype)")
    e.add_argument("--index-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="the DSA indexer keys' cache, apart from --kv-cache-dtype (auto: the same; fp8: e4m3 with a "
                        "scale per key, about half the bytes)")
    e.add_argument("--expert-compute", default="auto", choices=list(COMPUTE),
                   help="packed MXFP4 experts: the workspace format they are converted into (bf16 | fp8), read "
                        "packed by the expert kernels (fused), or per step (auto: packed for steps of at most "
                        f"{FUSED_ROWS_PER_EXPERT} rows per expert, a bf16 workspace above)")
    e.add_argument("--fp8-activations", action="store_true",
                   help="block-FP8 routed experts multiply activations quantised to e4m3 per token and 128 channels, "
                        "on FP8 tensor cores (the checkpoint's dynamic activation scheme; default: exact activations)")
    e.add_argument("--high-precision-layers", type=int, nargs="+", default=(), metavar="I",
                   help="layers whose packed experts are dequantised once at load")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    e.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap each step's host work with the next step on the device (same outputs; default: on "
                        "for CUDA devices)")
    e.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default 1 2 4 8 16 24 .. --max-num-seqs)")
    e.add_argument("--cuda-graph-max-len", type=int, default=8192, metavar="L",
                   help="decode steps with a longer sequence run eagerly")
    e.add_argument("--cuda-graph-prefill-tokens", type=int, default=2048, metavar="T",
                   help="prefill and mixed steps of up to T rows replay CUDA graphs captured at load (0: eager)")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the cached blocks and state snapshots of a prefix shared with an earlier request")
    e.add_argument("--prefix-snapshot-interval", type=int, default=512, metavar="T",
                   help="tokens between state snapshots of models with per-sequence states")
    e.add_argument("--num-prefix-snapshots", type=int, default=None, metavar="N",
                   help=f"state snapshots kept (default: one per sequence seat, and up to "
                        f"{SPARE_SNAPSHOTS_PER_SEAT} more a seat from cache memory the blocks leave unused)")
    e.add_argument("--prefix-eviction-policy", choices=EVICTION_POLICIES, default="adaptive",
                   help="which cached block or state snapshot goes when its pool is full: LRU, or as bimodal "
                        "insertion would when prompts come back in cycles longer than the pool, whichever would "
                        "have resumed more (adaptive); or always LRU")
    e.add_argument("--host-cache-gib", type=float, default=0.0, metavar="GIB",
                   help="pinned host memory for the prefix-cache blocks and snapshots the device evicts")
    d = p.add_argument_group("parallelism (one process per rank: started here, or the ranks of a torchrun job)")
    d.add_argument("--tp", type=positive_int, default=1, metavar="N", help="tensor-parallel ranks")
    d.add_argument("--ep", type=positive_int, default=1, metavar="N",
                   help="expert-parallel ranks, dividing a pipeline stage's G ranks: 1 (experts split by tp), G, "
                        "or in between (each expert's width split over G/ep ranks)")
    d.add_argument("--pp", type=positive_int, default=1, metavar="N", help="pipeline stages (of max(tp·dp, ep) ranks)")
    d.add_argument("--dp", type=positive_int, default=1, metavar="N",
                   help="attention data parallelism: N replicas of tp ranks, each holding sequences of its own "
                        "(ep 1, tp·dp, or expert-TP groups inside a replica)")
    d.add_argument("--pp-micro-batches", type=int, default=0, metavar="M",
                   help="run steps of several sequences as up to M micro-batches (of at least 32 rows) so the "
                        "pipeline stages overlap (0: twice the stages; 1: whole steps)")
    d.add_argument("--num-redundant-experts", type=int, default=0, metavar="R",
                   help="extra expert slots per MoE layer over the ep ranks, for copies of the hottest experts")
    d.add_argument("--eplb-interval", type=int, default=0, metavar="STEPS",
                   help="recompute where the experts live from the observed loads every STEPS steps (0: never)")
    d.add_argument("--distributed-host", default="127.0.0.1", metavar="ADDR",
                   help="address the ranks meet on (rank 0's); torchrun's MASTER_ADDR when set")
    d.add_argument("--distributed-port", type=port, default=None, metavar="PORT",
                   help="rendezvous port (default: a free one); torchrun's MASTER_PORT when set")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """``EngineConfig`` / ``LLM`` keyword arguments from a command's options (the one mapping for all)."""
    from dayzero.engine.engine import EngineConfig

    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}


# --- MODEL ---------------------------------------------------------------------------------------------
def has_weights(path: Path) -> bool:
    return path.is_dir() and (any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists())


def check_model(text: str, command: str, need_weights: bool = False, what: str = "MODEL") -> None:
    """Refuse a MODEL that cannot be one before anything loads, saying what it must be."""
    path = Path(text)
    if not path.exists():
        raise FileNotFoundError(f"no config.json at {text}: the path does not exist; {what} is {MODEL_FORMS}")
    if path.is_dir() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json at {text}: {what} is {MODEL_FORMS}")
    check_config(path)
    if need_weights and not has_weights(path):
        raise FileNotFoundError(f"{text} has no weights (*.safetensors): {command} needs a checkpoint directory, "
                                f"or --load-format dummy for random weights from the config")


def check_config(path: Path) -> None:
    """The config parses into a model spec; a malformed one is refused naming the file."""
    import json

    from dayzero.models.registry import adapter_for, read_config

    file = path / "config.json" if path.is_dir() else path
    try:
        raw, _ = read_config(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file} is not a config: a JSON object is needed, got {type(raw).__name__}")
    adapter = adapter_for(raw, file)  # unknown model_type: ValueError naming the supported ones
    try:
        adapter.to_spec(raw)
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        missing = re.search(r"missing \d+ required (?:positional |keyword-only )?arguments?: (.+)", str(e))
        what = f"missing key {e}" if isinstance(e, KeyError) else f"missing key {missing.group(1)}" if missing else str(e)
        raise ValueError(f"{file} is not a valid {raw.get('model_type')} config: {what}") from None
