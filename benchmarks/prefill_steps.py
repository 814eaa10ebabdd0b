"""Short prefill steps: the wall time of one sequence's prefill step by prompt length, and where the host spends it.

    python benchmarks/prefill_steps.py --config configs/dayzero-small.json --device cuda \
        --lengths 16 64 256 512 2048 [--cprofile FILE --cprofile-len 512] [--json FILE]

A prompt of L tokens is prefilled in one step (the token budget is the longest length), after a warm-up prompt of
the same length (Triton compiles per shape class); each length is timed over ``--repeats`` prompts, each a new
random one (no prefix-cache hits), with the device synchronised around the step. The table gives the step's
milliseconds, tokens/s and the FLOP roofline of the step (2 × active parameters per token over the matmul rate
measured in the run), which shows whether a short step costs what its tokens cost or what its launches cost.
On a GPU each length is timed twice in one run, on one engine: its steps replayed from the prefill CUDA graphs,
then run eagerly (the graphs set aside), so the ratio is measured side by side. ``--cprofile FILE`` runs one
eager step of ``--cprofile-len`` tokens under cProfile and writes the functions with the most host time (own
and cumulative) to FILE.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from dayzero import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import active_params, measured_ceilings  # noqa: E402


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prefill_once(eng, ids: list[int], dev, profiler: cProfile.Profile | None = None) -> float:
    """Seconds of the steps that bring one prompt into the cache and sample its first token."""
    eng.add_request(f"prefill-{time.perf_counter_ns()}", ids, SamplingParams(max_tokens=1, temperature=0.0,
                                                                             ignore_eos=True))
    _sync(dev)
    if profiler is not None:
        profiler.enable()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    _sync(dev)
    seconds = time.perf_counter() - t
    if profiler is not None:
        profiler.disable()
    return seconds


def host_profile(eng, ids: list[int], dev, path: str) -> None:
    prof = cProfile.Profile()
    prefill_once(eng, ids, dev, prof)
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(45)
    with open(path, "w") as f:
        f.write(out.getvalue())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 512, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cprofile", default=None, metavar="FILE")
    ap.add_argument("--cprofile-len", type=int, default=512)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    extra = {"enforce_eager": True} if args.enforce_eager else {}
    longest = max(args.lengths + [args.cprofile_len])
    llm = LLM(args.config, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=8,
              max_num_batched_tokens=longest, max_model_len=longest + 8, **extra)
    eng = llm.engine
    dev, spec = eng.device, eng.model_config
    _, active = active_params(eng.model, spec)
    _, flops = measured_ceilings(dev)
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(0, spec.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    runner = eng.runner
    graphs = runner.prefill_graphs
    modes = [("graphs", graphs), ("eager", None)] if graphs is not None else [("eager", None)]
    rows = []
    for n in args.lengths:
        row = {"tokens": n, "roofline_ms": 1e3 * 2 * active * n / flops}
        for mode, g_set in modes:
            runner.prefill_graphs = g_set
            prefill_once(eng, draw(n), dev)  # warm: compiles this length's shape classes
            times = [prefill_once(eng, draw(n), dev) for _ in range(args.repeats)]
            row[f"{mode}_ms"] = 1e3 * statistics.median(times)
        runner.prefill_graphs = graphs
        rows.append(row)
    print(f"{args.config} on {dev}: one sequence's prefill step and first token (median of {args.repeats}); "
          f"prefill steps: {getattr(eng, 'prefill_mode', 'eager')}")
    head = "".join(f"{m + ' ms':>12}" for m, _ in modes)
    print(f"{'tokens':>7}{head}{'ratio':>8}{'tok/s':>10}{'roofline ms':>13}{'of roofline':>13}")
    for r in rows:
        best = r[f"{modes[0][0]}_ms"]
        ratio = f"{r['eager_ms'] / best:>7.2f}x" if len(modes) > 1 else f"{'':>8}"
        print(f"{r['tokens']:>7}" + "".join(f"{r[m + '_ms']:>12.2f}" for m, _ in modes) + ratio
              + f"{r['tokens'] / best * 1e3:>10.0f}{r['roofline_ms']:>13.3f}{r['roofline_ms'] / best:>12.1%}")
    if args.cprofile:
        runner.prefill_graphs = None
        prefill_once(eng, draw(args.cprofile_len), dev)
        host_profile(eng, draw(args.cprofile_len), dev, args.cprofile)
        runner.prefill_graphs = graphs
        print(f"host profile of an eager {args.cprofile_len}-token step: {args.cprofile}")
    result = {"config": args.config, "device": str(dev), "rows": rows, "capture_s": getattr(graphs, "seconds", 0),
              "graph_bytes": getattr(graphs, "nbytes", 0), "prefill_mode": getattr(eng, "prefill_mode", "eager")}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
