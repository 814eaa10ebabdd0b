"""One long prompt at a time: chunked prefill to the context, then decode, beside what ``dayzero plan`` predicted.

    python benchmarks/long_context.py --config configs/dayzero-small.json --device cuda \
        --contexts 4096 131072 1000000 --decode 64 --chunk 16384 --json FILE

Random weights from the config (``load_format="dummy"``). One engine is built for the longest context (its
cache budget is what :func:`dayzero.tools.plan.predict_allocation` says one sequence of that length needs, plus
2%, so a plan that under-counts stops the run with the engine's own message), decode CUDA graphs captured up to
that length. For each context in turn a single request of that many random tokens is prefilled in chunks of
``--chunk`` tokens (progress printed as it goes) and decodes ``--decode`` tokens, greedy with EOS ignored.
Printed per context: prefill seconds and tokens/s, decode tokens/s and ms per step, peak device memory, and the
plan's prediction of the same quantities (its roofline decode and prefill rates, its memory terms). On a
hybrid model a KDA layer's decode cost does not depend on the context; a DSA layer's grows only through the
indexer, which reads every cached key once per step.

When the config's ``max_position_embeddings`` is below the longest context, a copy of the config with the
maximum raised (and a YaRN factor scaled to match) is written to a temporary directory and used for both the
engine and the plan: the weights are random, so this measures the engine, not a trained extension.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from dayzero import LLM, SamplingParams
from dayzero.tools.devices import DEVICES
from dayzero.tools.plan import PlanConfig, plan, predict_allocation

GIB = 1 << 30


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def long_config(path: str, tokens: int, out_dir: str) -> str:
    """``path``, or a copy whose maximum position covers ``tokens`` (a power of two, YaRN factor scaled)."""
    raw = json.loads(Path(path).read_text())
    if raw.get("max_position_embeddings", 0) >= tokens:
        return path
    top = 1 << math.ceil(math.log2(tokens))
    rope = raw.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("original_max_position_embeddings"):
        raw["rope_scaling"] = {**rope, "factor": top / rope["original_max_position_embeddings"]}
    raw["max_position_embeddings"] = top
    dst = Path(out_dir) / Path(path).name
    dst.write_text(json.dumps(raw, indent=2))
    print(f"{path}: max_position_embeddings {top} in a copy of the config ({dst.name}), random weights", flush=True)
    return str(dst)


def predicted(config: str, dtype: str, context: int, chunk: int, device: str) -> dict:
    """The plan's figures for one sequence of ``context`` tokens on one H200 (memory alone off CUDA, where the
    plan has no device model to time)."""
    kind = DEVICES.get("h200") if device == "cuda" else None
    row = plan(config, PlanConfig(device=kind, context=context, prefill_chunk=chunk, dtype=dtype))["best"]
    return {"decode_tok_s": row.get("decode_tokens_per_s"), "prefill_tok_s": row.get("prefill_tokens_per_s"),
            "memory_bytes": row["total"], "memory": row["memory"], "max_context": row.get("max_context")}


def run_one(eng, context: int, decode: int, vocab: int, g: torch.Generator, dev: torch.device) -> dict:
    """Prefill one ``context``-token prompt (progress every ~10%), then decode ``decode`` tokens."""
    ids = torch.randint(0, vocab, (context,), generator=g).tolist()
    eng.add_request(f"long-{context}-{time.perf_counter_ns()}", ids,
                    SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True))
    seq = eng.scheduler.waiting[-1]
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t0 = time.perf_counter()
    mark = 0.1
    while seq.num_computed < seq.num_prompt_tokens:
        eng.step()
        if seq.num_computed >= mark * context and seq.num_computed < context:
            el = time.perf_counter() - t0
            print(f"  prefill {seq.num_computed:>9,}/{context:,} tokens  {el:7.1f} s  "
                  f"{seq.num_computed / el:9,.0f} tok/s", flush=True)
            mark = seq.num_computed / context + 0.1
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    _sync(dev)
    decode_s = time.perf_counter() - t1
    out = len(seq.output_ids) if hasattr(seq, "output_ids") else decode + 1
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    return {"context": context, "prefill_s": prefill_s, "prefill_tok_s": context / prefill_s,
            "decode_tokens": out - 1, "decode_tok_s": decode / decode_s, "decode_step_ms": 1e3 * decode_s / decode,
            "peak_bytes": peak}


def build(config: str, args, longest: int) -> LLM:
    """The engine for ``longest`` tokens, its cache budget what the plan predicts for one such sequence (+2%)."""
    dtype = "fp32" if args.dtype == "float32" else "bf16"
    cache = predict_allocation(config, dtype, longest, 1)["cache"]
    common = dict(device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=1,
                  max_num_batched_tokens=args.chunk, max_model_len=longest, cuda_graph_max_len=longest)
    try:
        llm = LLM(config, cache_memory_bytes=int(cache * 1.02), **common)
        print(f"cache budget: the plan's {cache / GIB:.2f} GiB for one {longest:,}-token sequence, +2%", flush=True)
    except ValueError as e:  # the plan under-counted: say so, and measure with the engine's default budget
        print(f"the plan's cache budget ({cache / GIB:.2f} GiB) was refused: {e}", flush=True)
        llm = LLM(config, **common)
    return llm


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 131072, 1000000])
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16384, help="prefill tokens per step")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    contexts = sorted(args.contexts)
    longest = contexts[-1] + args.decode + 1
    tmp = tempfile.mkdtemp(prefix="long-context-")
    config = long_config(args.config, longest, tmp)
    t0 = time.perf_counter()
    llm = build(config, args, longest)
    eng = llm.engine
    dev, vocab = eng.device, eng.model_config.vocab_size
    print(f"{config}: built in {time.perf_counter() - t0:.1f} s on {dev}; decode: "
          f"{getattr(eng, 'decode_mode', 'eager')}", flush=True)
    g = torch.Generator().manual_seed(0)
    warm = min(contexts[0], args.chunk)
    run_one(eng, warm, 4, vocab, g, dev)  # compiles and autotunes every kernel at the chunk's shapes
    dtype = "fp32" if args.dtype == "float32" else "bf16"
    rows = []
    for context in contexts:
        print(f"context {context:,}:", flush=True)
        r = run_one(eng, context, args.decode, vocab, g, dev)
        r["plan"] = predicted(config, dtype, context + args.decode + 1, args.chunk, args.device)
        rows.append(r)
        if args.json:  # after every context: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"config": args.config, "device": str(dev), "rows": rows}, indent=2))
    print(f"\n{'context':>9} {'prefill s':>10} {'prefill tok/s':>14} {'plan':>9} {'decode tok/s':>13} {'plan':>8} "
          f"{'step ms':>8} {'peak GiB':>9} {'plan GiB':>9}")
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in rows:
        p, peak = r["plan"], r["peak_bytes"]
        print(f"{r['context']:>9,} {r['prefill_s']:>10.1f} {r['prefill_tok_s']:>14,.0f} {fmt(p['prefill_tok_s'], ',.0f'):>9} "
              f"{r['decode_tok_s']:>13.1f} {fmt(p['decode_tok_s'], '.0f'):>8} {r['decode_step_ms']:>8.2f} "
              f"{fmt(peak and peak / GIB, '.2f'):>9} {p['memory_bytes'] / GIB:>9.2f}")
    base = rows[0]
    for r in rows[1:]:
        print(f"decode at {r['context']:,} tokens: {r['decode_tok_s'] / base['decode_tok_s']:.2f}x the rate at "
              f"{base['context']:,}")
    return {"rows": rows}


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
