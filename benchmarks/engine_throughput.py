"""Offline engine throughput: prefill and decode tokens/s through the real engine path, with a roofline.

    python benchmarks/engine_throughput.py --config configs/dayzero-small.json --device cuda \
        --batch 1 8 32 64 --prompt-len 512 --decode 32 [--baseline DIR | --compare-async] [--busy 32] [--enforce-eager]

Random weights from the config (``load_format="dummy"``). For each batch size it prefills ``batch`` prompts
of ``--prompt-len`` tokens, then decodes ``--decode`` steps, timing each phase with the device synchronised.
The roofline for decode is the bytes a step must move (weights read once, the experts its tokens hit only, plus
the KV/state bytes read) over the measured copy bandwidth; for prefill, FLOPs (2 × active parameters per
token) over the measured matmul rate. Prints a table; ``--json FILE`` writes the numbers.

Prefill is timed over the steps that bring every prompt into the cache, decode over the steps after them.
``--baseline DIR`` first runs this script on the package in ``DIR`` (a copy of an earlier version:
``git archive REV dayzero | tar -x -C DIR``) in a subprocess with the same arguments, then on this version,
and prints both side by side with the ratio: only numbers measured in one run are compared.
``--compare-async`` does the same with this version twice: steps not overlapped, then ``--async-scheduling``.
``--baseline-env K=V[,K=V...]`` runs the baseline (this version, or DIR's) with those environment settings, e.g.
``DAYZERO_PDL=0`` for this version without programmatic dependent launch; given more than once, each is a
baseline of its own, every one run before this version and compared with it.
``--busy B`` profiles a few decode steps at batch B with the torch profiler
and reports the fraction of each step the GPU spends in kernels; with a baseline, on both sides, and the side by
side flags a side busy less than :data:`IDLE_WARNING` of its steps (its GPU waited on its host in that run, so
that run's ratio is not the kernels').
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: its shared helpers
from baseline import run_on  # noqa: E402
from dayzero import LLM, SamplingParams  # noqa: E402
from dayzero.config.spec import MoESpec  # noqa: E402
from dayzero.quant.workspace import COMPUTE  # noqa: E402


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measured_ceilings(dev) -> tuple[float, float]:
    """(copy bandwidth in bytes/s, bf16 matmul FLOP/s) measured on this device."""
    n = 1 << 28 if dev.type == "cuda" else 1 << 24
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    _sync(dev)
    bw = 2 * n * 10 / (time.perf_counter() - t)
    m = 8192 if dev.type == "cuda" else 512
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w = torch.randn(m, m, device=dev, dtype=dt), torch.randn(m, m, device=dev, dtype=dt)
    x @ w
    _sync(dev)
    t = time.perf_counter()
    for _ in range(5):
        x @ w
    _sync(dev)
    return bw, 2 * m**3 * 5 / (time.perf_counter() - t)


ROUTED = ("w1", "w2", "w1_scale_inv", "w2_scale_inv", "w1_blocks", "w1_scales", "w2_blocks", "w2_scales")


def _routed(layer) -> tuple[int, int]:
    """(weights, bytes) of a MoE layer's routed experts as stored: dense, FP8 with scales, or packed MXFP4 (two
    weights a byte in ``*_blocks``)."""
    weights = sum(getattr(layer, n).numel() * (2 if n.endswith("_blocks") else 1) for n in ("w1", "w2", "w1_blocks", "w2_blocks")
                  if hasattr(layer, n))
    nbytes = sum(getattr(layer, n).numel() * getattr(layer, n).element_size() for n in ROUTED if hasattr(layer, n))
    return weights, nbytes


def _moe_layers(model, spec):
    return [(layer.mlp, ls.mlp) for layer, ls in zip(model.model.layers, spec.layers) if isinstance(ls.mlp, MoESpec)]


def active_params(model, spec) -> tuple[int, int]:
    """(total parameters, parameters one token touches), embeddings aside in the second; packed MXFP4 experts
    count their weights, not their bytes."""
    stored = sum(p.numel() for p in model.parameters())
    total, inactive = stored, 0
    for mlp, ms in _moe_layers(model, spec):
        weights, _ = _routed(mlp)
        total += weights - sum(getattr(mlp, n).numel() for n in ROUTED if hasattr(mlp, n))  # logical, not stored
        inactive += weights * (1 - ms.top_k / ms.n_experts)
    return total, int(total - inactive - model.model.embed_tokens.weight.numel())


def weight_bytes(model, spec, batch: int, context: int | None = None) -> float:
    """Bytes of weights a decode step of ``batch`` sequences reads, embeddings aside: every dense weight once, and
    of each MoE layer's routed experts (in their stored format) the share that ``batch`` tokens hit, by uniform
    routing 1 - (1 - k/E)^batch. With ``context`` (tokens a sequence holds) no more than a DSA indexer's topk,
    that indexer selects every key, so its query and head-weight projections are not counted (only its key's)."""
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    dense -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    for m in model.modules():
        indexer = getattr(m, "indexer", None)
        if context is not None and indexer is not None and hasattr(indexer, "wq_b") and context <= indexer.topk:
            dense -= sum(p.numel() * p.element_size() for p in (indexer.wq_b.weight, indexer.weights_proj.weight))
    hit = 0.0
    for mlp, ms in _moe_layers(model, spec):
        _, nbytes = _routed(mlp)
        dense -= nbytes
        hit += nbytes * (1 - (1 - ms.top_k / ms.n_experts) ** batch)
    return dense + hit


def timed(eng, prompts: list[list[int]], decode: int, dev, images: list | None = None) -> tuple[float, float, int, list]:
    """(prefill seconds, decode seconds, decode steps, the sequences) of ``prompts`` through the engine's step
    loop, greedy and EOS ignored: the steps until every prompt is in the cache (sampling the first token), then
    the ``decode`` steps after them. Uses only the engine's public step loop, so it also times earlier versions."""
    sp = SamplingParams(max_tokens=decode + 1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):  # images (each prompt's list) only when given: earlier versions lack them
        extra = {"images": images[i]} if images is not None else {}
        eng.add_request(f"bench-{time.perf_counter_ns()}-{i}", ids, sp, **extra)
    seqs = list(eng.scheduler.waiting)
    _sync(dev)
    t = time.perf_counter()
    while any(s.num_computed < s.num_prompt_tokens for s in seqs):
        eng.step()
    _sync(dev)
    prefill_s, t = time.perf_counter() - t, time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    _sync(dev)
    # every sequence decodes ``decode`` tokens after the prefill's (counted as tokens, not step calls: with
    # overlapped steps the last call only reads the final step's samples)
    return prefill_s, time.perf_counter() - t, decode, seqs


def gpu_busy(llm, batch: int, prompt_len: int, steps: int, vocab: int, table_file: str | None = None) -> dict:
    """Fraction of decode-step wall time the GPU spends in kernels (union of kernel intervals from the torch
    profiler over ``steps`` decode steps of ``batch`` sequences), kernels launched per step."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)  # the prefill's, a warm step, then steps
    for i in range(batch):
        eng.add_request(f"busy{i}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), sp)
    while any(s.num_computed < s.num_prompt_tokens for s in eng.scheduler.running + list(eng.scheduler.waiting)):
        eng.step()
    eng.step()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    busy, kernels = kernel_spans(prof)
    while eng.has_unfinished():
        eng.step()
    if table_file:
        with open(table_file, "w") as f:
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                f.write(prof.key_averages().table(sort_by=key, row_limit=40) + "\n\n")
            f.write(step_timeline(prof, kernels // steps))
    return {"batch": batch, "busy_fraction": busy * 1e-6 / wall, "kernels_per_step": kernels / steps,
            "step_ms": 1e3 * wall / steps}


def step_timeline(prof, per_step: int) -> str:
    """The last step's kernels in launch order (:func:`timeline`)."""
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)[-per_step:]
    return timeline(ks)


def timeline(ks: list[tuple[float, float, str]]) -> str:
    """Kernels (start, end, name; in microseconds, in launch order) as a table: start from the first, duration,
    gap before (negative: it started before the one before it ended, as under programmatic dependent launch) and
    the time it added to the step (its end less the latest end before it: overlapping spans counted once, an idle
    gap before it included); then the added time summed by kernel name, largest first."""
    lines = [f"kernels of one decode step in order ({len(ks)}):", f"{'start':>9} {'us':>7} {'gap':>6} {'added':>6}  name"]
    added, last = {}, None
    for i, (a, b, name) in enumerate(ks):
        gap = a - ks[i - 1][1] if i else 0.0
        add = b - a if last is None else max(0.0, b - last)
        last = b if last is None else max(last, b)
        calls, total = added.get(name, (0, 0.0))
        added[name] = (calls + 1, total + add)
        lines.append(f"{a - ks[0][0]:>9.1f} {b - a:>7.1f} {gap:>6.1f} {add:>6.1f}  {name[:110]}")
    step = sum(t for _, t in added.values())
    lines += ["", f"time added to the step by kernel ({step:.1f} us in all):",
              f"{'us':>8} {'share':>6} {'calls':>6} {'us a call':>9}  name"]
    for name, (calls, total) in sorted(added.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{total:>8.1f} {total / step if step else 0.0:>6.1%} {calls:>6} {total / calls:>9.2f}  {name[:100]}")
    return "\n".join(lines) + "\n"


def kernel_spans(prof) -> tuple[float, int]:
    """(microseconds the GPU spent in kernels, the union of their intervals; how many kernels) of a profile."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    busy, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy, len(spans)


def prefill_profile(llm, prompt_len: int, vocab: int, table_file: str) -> dict:
    """One batch-1 prefill step of ``prompt_len`` tokens under the profiler (after a warm one): its wall time,
    the GPU's busy share of it, kernels launched, and the profiler's tables (GPU and host time) in ``table_file``."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    g = torch.Generator().manual_seed(2)
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for run in range(2):
        eng.add_request(f"prefill{run}", torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), sp)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
    busy, kernels = kernel_spans(prof)
    with open(table_file, "w") as f:
        for key in ("self_cuda_time_total", "cpu_time_total"):
            f.write(prof.key_averages().table(sort_by=key, row_limit=50) + "\n\n")
    return {"prompt_len": prompt_len, "wall_ms": 1e3 * wall, "busy_fraction": busy * 1e-6 / wall, "kernels": kernels}


IDLE_WARNING = 0.75  # a side busy less than this share of its profiled steps is flagged as waiting on its host


def busy_line(base: dict, this: dict) -> str:
    """The side by side of two ``gpu_busy`` results, flagged where a side's GPU mostly waits on its host (then the
    decode ratio of that run says more about the host than about the kernels)."""
    line = (f"GPU busy at batch {this['batch']} (profiled steps): {base['busy_fraction']:.1%} -> "
            f"{this['busy_fraction']:.1%}, {base['kernels_per_step']:.0f} -> {this['kernels_per_step']:.0f} kernels "
            "a step")
    idle = [side for side, b in (("baseline", base), ("this version", this)) if b["busy_fraction"] < IDLE_WARNING]
    if idle:
        line += (f"; {' and '.join(idle)} busy less than {IDLE_WARNING:.0%}: waiting on the host, the decode ratio "
                 "is not the kernels'")
    return line


def run_baseline(args, settings: str | None = None) -> dict | None:
    """This script's numbers for the baseline: ``--baseline``'s package (else this one) with the environment
    ``settings`` (``K=V,K=V``) applied, or this version without overlapped steps (``--compare-async``)."""
    cmd = ["--config", args.config, "--device", args.device, "--dtype", args.dtype,
           "--batch", *map(str, args.batch), "--prompt-len", str(args.prompt_len), "--decode", str(args.decode)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.compare_async:
        cmd.append("--no-async-scheduling")
    elif args.async_scheduling is not None:  # the same setting on both sides
        cmd.append("--async-scheduling" if args.async_scheduling else "--no-async-scheduling")
    if args.expert_compute:
        cmd += ["--expert-compute", args.expert_compute]
    if args.fp8_activations:
        cmd.append("--fp8-activations")
    if args.busy:  # both sides profiled: a side whose GPU waits on its host shows it
        cmd += ["--busy", str(args.busy)]
    env = {}
    for item in filter(None, (settings or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--baseline-env takes K=V settings, got {item!r}")
        env[key.strip()] = value.strip()
    what = "this version, steps not overlapped" if args.compare_async else (args.baseline or "this version")
    return run_on(__file__, cmd, args.baseline, env, what + (", " + settings if settings else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, metavar="DIR", help="an earlier version's package, run first, side by side")
    ap.add_argument("--busy", type=int, default=None, metavar="B", help="GPU busy fraction of decode steps at batch B")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--profile-table", default=None, metavar="FILE", help="with --busy: the profiler's op tables")
    ap.add_argument("--prefill-profile", default=None, metavar="FILE",
                    help="profile one batch-1 prefill step (CUDA): wall time, GPU busy share, kernels; tables in FILE")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap each step's host work with the next step (default: the engine's, on for CUDA)")
    ap.add_argument("--expert-compute", default=None, choices=list(COMPUTE),
                    help="packed MXFP4 experts: the workspace format they are converted into, or read packed")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="FP8 routed experts multiply activations rounded to FP8 (block-FP8, or MXFP4 through the FP8 "
                         "tile workspace)")
    ap.add_argument("--compare-async", action="store_true",
                    help="the baseline is this version without overlapped steps; this run overlaps them")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="K=V[,K=V]",
                    help="run the baseline with these environment settings (again for another baseline)")
    args = ap.parse_args()
    if args.compare_async:
        args.async_scheduling = True
    if args.baseline_env:
        bases = [(f"{args.baseline or 'this version'}, {e}", run_baseline(args, e)) for e in args.baseline_env]
    elif args.baseline or args.compare_async:
        bases = [(args.baseline or "this version, steps not overlapped", run_baseline(args))]
    else:
        bases = []

    t0 = time.perf_counter()
    extra = {"enforce_eager": True} if args.enforce_eager else {}
    if args.async_scheduling is not None:  # else the version's own default (earlier ones lack the option)
        extra["async_scheduling"] = args.async_scheduling
    if args.expert_compute:
        extra["expert_compute"] = args.expert_compute
    if args.fp8_activations:
        extra["fp8_activations"] = True
    llm = LLM(args.config, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=max(args.batch),
              max_num_batched_tokens=max(args.batch) * args.prompt_len, max_model_len=args.prompt_len + args.decode + 1,
              **extra)
    eng = llm.engine
    dev, spec = eng.device, eng.model_config
    total, active = active_params(eng.model, spec)
    bw, flops = measured_ceilings(dev)
    print(f"{args.config}: {total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active per token, embeddings aside) "
          f"on {dev} in {str(eng.dtype).removeprefix('torch.')}; built in {time.perf_counter() - t0:.1f}s; "
          f"measured copy {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.1f} TFLOP/s; decode: "
          f"{getattr(eng, 'decode_mode', 'eager')}", flush=True)
    rows = []
    g = torch.Generator().manual_seed(0)
    state_bytes = sum(s.bytes_per_seq() for s in eng.runner.specs if hasattr(s, "tensors"))
    kv_bytes = sum(s.bytes_per_token() for s in eng.runner.specs if hasattr(s, "rows"))
    for bsz in args.batch:
        draw = lambda n: [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for _ in range(bsz)]  # noqa: E731
        # warm-up at this batch size and prompt length: the timed run then finds every kernel compiled (Triton
        # compiles a kernel the first time it meets a new shape class, e.g. a new MoE row bucket)
        timed(eng, draw(args.prompt_len), 4, dev)
        prefill_s, decode_s, steps, _ = timed(eng, draw(args.prompt_len), args.decode, dev)
        # a decode step reads its weights once (the experts its tokens hit), every sequence's KV rows, and reads +
        # writes its states
        context = args.prompt_len + args.decode
        step_bytes = weight_bytes(eng.model, spec, bsz, context) + bsz * (args.prompt_len * kv_bytes + 2 * state_bytes)
        rows.append({
            "batch": bsz, "prefill_tok_s": bsz * args.prompt_len / prefill_s, "decode_tok_s": bsz * steps / decode_s,
            "decode_step_ms": 1e3 * decode_s / steps,
            "decode_roofline_ms": 1e3 * step_bytes / bw,
            "prefill_roofline_tok_s": flops / (2 * active),
        })
    print(f"{'batch':>5} {'prefill tok/s':>14} {'roofline':>10} {'decode tok/s':>13} {'step ms':>9} {'roofline ms':>12} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['prefill_tok_s']:>14.0f} {r['prefill_roofline_tok_s']:>10.0f} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_step_ms']:>9.1f} {r['decode_roofline_ms']:>12.2f} {r['decode_roofline_ms'] / r['decode_step_ms']:>11.1%}")
    busy = None
    if args.busy and dev.type == "cuda":
        busy = gpu_busy(llm, args.busy, args.prompt_len, max(1, min(16, args.decode - 1)), spec.vocab_size,
                        args.profile_table)
        print(f"decode at batch {busy['batch']}: GPU busy {busy['busy_fraction']:.1%} of the step "
              f"({busy['step_ms']:.2f} ms, {busy['kernels_per_step']:.0f} kernels per step)")
    prefill = None
    if args.prefill_profile and dev.type == "cuda":
        prefill = prefill_profile(llm, args.prompt_len, spec.vocab_size, args.prefill_profile)
        print(f"prefill of {prefill['prompt_len']} tokens at batch 1: {prefill['wall_ms']:.1f} ms, GPU busy "
              f"{prefill['busy_fraction']:.1%} of it, {prefill['kernels']} kernels (tables: {args.prefill_profile})")
    for label, base in bases:
        if base is None:
            continue
        print(f"\nside by side (same run): baseline ({label}) -> this version")
        print(f"{'batch':>5} {'prefill tok/s':>22} {'ratio':>6} {'decode tok/s':>20} {'ratio':>6} {'of roofline':>16}")
        for r, b in zip(rows, base["rows"]):
            print(f"{r['batch']:>5} {b['prefill_tok_s']:>10.0f} -> {r['prefill_tok_s']:>8.0f} "
                  f"{r['prefill_tok_s'] / b['prefill_tok_s']:>5.2f}x {b['decode_tok_s']:>8.1f} -> {r['decode_tok_s']:>8.1f} "
                  f"{r['decode_tok_s'] / b['decode_tok_s']:>5.2f}x "
                  f"{b['decode_roofline_ms'] / b['decode_step_ms']:>6.1%} -> {r['decode_roofline_ms'] / r['decode_step_ms']:>6.1%}")
        if busy is not None and base.get("busy"):
            print(busy_line(base["busy"], busy))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": str(dev), "bandwidth": bw, "flops": flops, "rows": rows,
                       "decode_mode": getattr(eng, "decode_mode", "eager"), "busy": busy, "prefill": prefill,
                       "baselines": [{"label": label, **(base or {})} for label, base in bases]}, f, indent=2)


if __name__ == "__main__":
    main()
