"""Engine throughput by parallel layout: one process against tp, ep and pp ranks on the same host, in one run.

    python benchmarks/parallel_layouts.py --config configs/dayzero-tiny.json --layouts 1 tp2 ep2 pp2 tp2,ep2 \
        --batch 8 --prompt-len 128 --decode 16 [--device cpu] [--json FILE]
    python benchmarks/parallel_layouts.py --layouts 1 pp2,mb1 pp2 pp2,mb4   # pipeline micro-batches
    python benchmarks/parallel_layouts.py --layouts 1 tp2,ep2 dp2,ep2 dp2   # attention data parallelism

Random weights from the config (``load_format="dummy"``). Each layout starts its ranks (Gloo on CPUs, NCCL on GPUs,
one device per rank), every rank runs the same engine steps: ``--batch`` prompts of ``--prompt-len`` tokens are
prefilled, then ``--decode`` steps decode (under ``dp`` each replica takes every dp-th prompt). Rank 0 times the
prefill steps and the decode steps. The CPU threads are split evenly between the ranks, so every layout uses the
same cores. Prints a table with each layout's tokens/s and its ratio to one process; only ratios of one run are
compared.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dayzero.distributed import destroy_parallel, init_parallel  # noqa: E402
from dayzero.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from dayzero.engine.sampling_params import SamplingParams  # noqa: E402


def parse_layout(text: str) -> dict[str, int]:
    """``1``, ``tp2``, ``ep2,pp2``, ``pp2,mb1``, ``dp2,ep2`` -> {"tp": .., "ep": .., "pp": .., "dp": .., "mb": ..}
    (``mb``: pipeline micro-batches, 0 = the engine's default, two per stage; ``dp``: attention data-parallel
    replicas)."""
    out = {"tp": 1, "ep": 1, "pp": 1, "dp": 1, "mb": 0}
    if text == "1":
        return out
    for part in text.split(","):
        key, num = part[:2], part[2:]
        if key not in out or not num.isdigit() or int(num) < 1:
            raise SystemExit(f"bad layout {text!r}: use e.g. 1, tp2, ep2, pp2, tp2,ep2, pp2,mb1, dp2,ep2")
        out[key] = int(num)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank(rank: int, layout: dict, world: int, port: int, args, threads: int, out: str) -> None:
    torch.set_num_threads(threads)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    state = init_parallel(tp=layout["tp"], ep=layout["ep"], pp=layout["pp"], dp=layout["dp"], backend=backend,
                          rank=rank, world_size=world, port=port)
    try:
        device = f"cuda:{rank}" if backend == "nccl" else args.device
        engine = LLMEngine(EngineConfig(model=args.config, load_format="dummy", device=device, dtype=args.dtype,
                                        max_num_seqs=args.batch, num_threads=threads, enforce_eager=True,
                                        pp_micro_batches=layout["mb"],
                                        max_num_batched_tokens=max(args.batch * args.prompt_len, 256),
                                        max_model_len=args.prompt_len + args.decode + 8), state)
        g = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            ids = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
            if i % state.dp_size == state.dp_rank:  # every replica takes every dp-th prompt
                engine.add_request(f"r{i}", ids, params)
        dev = engine.device
        _sync(dev)
        t0, prefill_steps = time.perf_counter(), 0
        while any(s.num_computed < s.num_prompt_tokens for seqs in engine.requests.values() for s in seqs):
            engine.step()
            prefill_steps += 1
        _sync(dev)
        t1, decoded = time.perf_counter(), 0
        while engine.has_unfinished():
            decoded += sum(1 for _ in engine.step())
        _sync(dev)
        t2 = time.perf_counter()
        if rank == 0:
            json.dump({"prefill_s": t1 - t0, "prefill_steps": prefill_steps, "decode_s": t2 - t1,
                       "decode_outputs": decoded}, open(out, "w"))
    finally:
        destroy_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: dict, args) -> dict:
    world = layout["pp"] * max(layout["tp"] * layout["dp"], layout["ep"])
    threads = max(1, args.threads // world)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        mp.spawn(_rank, args=(layout, world, _free_port(), args, threads, out), nprocs=world, join=True)
        r = json.load(open(out))
    tokens = args.batch * args.prompt_len
    return {**r, "world": world, "threads_per_rank": threads, "prefill_tok_s": tokens / r["prefill_s"],
            "decode_tok_s": args.batch * (args.decode - 1) / r["decode_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/dayzero-tiny.json")
    ap.add_argument("--layouts", nargs="+", default=["1", "tp2", "ep2", "pp2"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads shared by the ranks")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for text in args.layouts:
        print(f"layout {text} ...", file=sys.stderr, flush=True)
        rows.append({"layout": text, **run_layout(parse_layout(text), args)})
    base = rows[0]
    print(f"{'layout':10} {'ranks':>5} {'threads/rank':>12} {'prefill tok/s':>14} {'x':>6} {'decode tok/s':>13} {'x':>6}")
    for r in rows:
        print(f"{r['layout']:10} {r['world']:>5} {r['threads_per_rank']:>12} {r['prefill_tok_s']:>14.1f} "
              f"{r['prefill_tok_s'] / base['prefill_tok_s']:>6.2f} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_tok_s'] / base['decode_tok_s']:>6.2f}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
