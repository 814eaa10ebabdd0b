"""Training throughput of the default model: tokens per second of whole training steps (data, forward, backward,
optimizer) with the training forward's fused kernels (:mod:`dayzero.train.fused`) on and off, side by side in one
run, on the same data, and the step's FLOPs against the bf16 matmul peak measured in the same run.

    python benchmarks/train_step.py --device cuda --steps 40

Each mode first runs a short warm-up job (its kernels compile and tune), then the modes alternate over
``--rounds`` timed jobs of ``--steps`` steps, each from the same checkpoint with a fresh optimizer and the same
seeded data (the bundled model's recipe, ``scripts/train_default.py --recipe bundled``: recall prompts of 192-8,192
tokens, sparse attention from half-way). The FLOPs are what ``torch.utils.flop_counter`` counts in one step (GEMMs
and attention; fla's KDA kernels are not counted, so the percentage is a floor). On CUDA each mode's peak allocated
memory is shown; a mode that runs out of memory is reported as such and the other mode's jobs still run.
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.timing import ms_per_call  # noqa: E402

MODES = {"reference ops": "off", "fused (fla)": "auto"}


def recipe(tokens: int):
    """The bundled model's data stream (``--recipe bundled``) at ``tokens`` a step, without its copies-first phase:
    the jobs start from the trained checkpoint, and every step of a short job should see the mix of the rest."""
    from dayzero.train.recipes import data_config, recipe_data

    return data_config(**{**recipe_data("bundled"), "copy_warmup": 0.0, "tokens": tokens})


def job(init: str, device, data, steps: int, fused_mode: str, workers: int) -> dict:
    """One training job of ``steps`` steps; returns its tokens and seconds (the device synchronised)."""
    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.train import fused
    from dayzero.train.checkpoint import load_model
    from dayzero.train.loop import TrainConfig, Trainer
    from dayzero.train.recipes import RECIPES

    model = load_model(init, device)
    config = TrainConfig(steps=steps, lr=4e-4, seed=0, data=data, workers=workers, log_every=10**9, warmup_steps=5,
                         sparse_from=RECIPES["bundled"]["sparse_from"])
    trainer = Trainer(model, load_tokenizer(DEFAULT_MODEL), config, device, log=lambda s: None)
    with fused.mode(fused_mode):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.monotonic()
        summary = trainer.train()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        summary["seconds"] = time.monotonic() - t
    return summary


def step_flops(init: str, device, data) -> tuple[float, int]:
    """FLOPs of one training step's forward and backward (torch's counter: GEMMs and SDPA), and its tokens."""
    from torch.utils.flop_counter import FlopCounterMode

    from dayzero.engine.engine import DEFAULT_MODEL
    from dayzero.engine.tokenizer import load_tokenizer
    from dayzero.train.batch import TrainBatch
    from dayzero.train.checkpoint import load_model
    from dayzero.train.data import StreamDataset
    from dayzero.train.forward import losses, training

    model = load_model(init, device)
    progress = mp.Value("d", 1.0)  # the end of training: the longest recall prompts
    step = next(iter(StreamDataset(data, load_tokenizer(DEFAULT_MODEL), 0, progress)))
    batch = TrainBatch(step.ids.to(device), step.lens, sparse=True)
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu")
    with FlopCounterMode(display=False) as counter:
        with autocast, training(model):
            out = losses(model, batch, step.targets.to(device), step.loss_weights.to(device))
        out.lm.backward()
    return float(counter.get_total_flops()), step.ids.numel()


def host_syncs(init: str, device, data, steps: int = 4) -> tuple[int, list]:
    """The synchronisations with the device in a job of ``steps`` steps (``torch.cuda.set_sync_debug_mode``: each
    op that waits for the device warns), with the lines that caused the most; (0, []) off CUDA."""
    if device.type != "cuda":
        return 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            job(init, device, data, steps, "auto", workers=0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    lines = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return len(syncs), lines.most_common(8)


def matmul_peak(device) -> float:
    n = 8192 if device.type == "cuda" else 1024
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)
    return 2 * n**3 / (ms_per_call(lambda: a @ b, 10, device.type) * 1e-3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--init", default=str(ROOT / "dayzero" / "assets" / "default"), help="checkpoint to train from")
    ap.add_argument("--steps", type=int, default=40, help="steps per timed job")
    ap.add_argument("--rounds", type=int, default=2, help="timed jobs per mode, the modes alternating")
    ap.add_argument("--warmup-steps", type=int, default=12,
                    help="steps of each mode's warm-up job (its kernels compile for the steps' shapes)")
    ap.add_argument("--tokens", type=int, default=98304, help="tokens per step")
    ap.add_argument("--workers", type=int, default=None, help="data worker processes (default 6 on CUDA, 0 on CPU)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from dayzero.engine.device import resolve_device

    device = resolve_device(args.device)
    workers = args.workers if args.workers is not None else (6 if device.type == "cuda" else 0)
    data = recipe(args.tokens)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"training steps of {Path(args.init).name} on {name}: {args.tokens} tokens a step, {args.steps} steps a job, "
          f"{args.rounds} rounds", flush=True)
    failed: dict[str, str] = {}  # mode -> why it stopped (out of memory): the other mode's rows still come
    peak_gib = {label: 0.0 for label in MODES}

    def timed(label: str, steps: int) -> dict | None:
        if label in failed:
            return None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            summary = job(args.init, device, data, steps, MODES[label], workers)
        except torch.OutOfMemoryError as exc:
            failed[label] = f"out of memory at {args.tokens} tokens a step"
            print(f"  {label}: {failed[label]} ({str(exc).splitlines()[0][:100]})", flush=True)
            summary = None
        if summary is None:  # the error's frames are gone here: their tensors can be freed
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return None
        if device.type == "cuda":
            peak_gib[label] = max(peak_gib[label], torch.cuda.max_memory_allocated(device) / 2**30)
        return summary

    for label in MODES:
        t = time.monotonic()
        if timed(label, args.warmup_steps) is not None:
            print(f"  warm-up of {label}: {time.monotonic() - t:.0f} s", flush=True)
    rates = {label: [] for label in MODES}
    for r in range(args.rounds):
        for label in MODES:
            s = timed(label, args.steps)
            if s is not None:
                rates[label].append(s["tokens"] / s["seconds"])
                print(f"  round {r + 1} {label}: {s['tokens'] / 1e6:.1f}M tokens in {s['seconds']:.1f} s", flush=True)
    syncs, lines = host_syncs(args.init, device, data) if "fused (fla)" not in failed else (0, [])
    flops, tokens = step_flops(args.init, device, data)
    peak = matmul_peak(device)
    base = statistics.mean(rates["reference ops"]) if rates["reference ops"] else None
    rows = []
    print(f"\n{'mode':<16}{'tokens/s':>12}{'ms/step':>10}{'vs reference':>14}{'TFLOP/s':>10}{'of peak':>9}"
          f"{'peak GiB':>10}")
    for label, rs in rates.items():
        if not rs:
            rows.append({"mode": label, "error": failed.get(label, "no timed job")})
            print(f"{label:<16}{rows[-1]['error']:>63}")
            continue
        rate = statistics.mean(rs)
        achieved = flops / tokens * rate
        rows.append({"mode": label, "tokens_per_s": rate, "ms_per_step": args.tokens / rate * 1e3,
                     "vs": None if base is None else rate / base, "flops_per_s": achieved, "of_peak": achieved / peak,
                     "peak_gib": peak_gib[label]})
        r = rows[-1]
        vs = "-" if r["vs"] is None else f"{r['vs']:.2f}x"
        mem = f"{peak_gib[label]:.1f}" if device.type == "cuda" else "-"
        print(f"{label:<16}{rate:>12,.0f}{r['ms_per_step']:>10.0f}{vs:>14}{achieved / 1e12:>10.1f}"
              f"{r['of_peak']:>9.1%}{mem:>10}")
    print(f"\nstep FLOPs counted {flops / 1e9:,.1f} G over {tokens} tokens; matmul peak measured "
          f"{peak / 1e12:.1f} TFLOP/s")
    if device.type == "cuda" and "fused (fla)" not in failed:
        print(f"host synchronisations in a 4-step job of the fused mode: {syncs}; most at "
              + ", ".join(f"{line} ({n})" for line, n in lines))
    return {"device": name, "rows": rows, "step_flops": flops, "peak": peak, "host_syncs": syncs}


if __name__ == "__main__":
    main()
