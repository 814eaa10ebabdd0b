"""Sliding-window layers under a fixed cache budget: how many sequences run at once, and how fast.

    python benchmarks/window_cache.py --device cpu --cache-mib 64 --requests 16 --prompt-len 1024 --decode 32 \
        [--baseline DIR]

A gpt-oss-shaped model with random weights (every other layer windowed to ``--window`` keys; the config is
written by this script, ``--config`` takes another) gets ``--cache-mib`` of cache; ``--requests`` prompts of
``--prompt-len`` random tokens are submitted at once, each decoding ``--decode`` tokens greedily. The table gives
the plan (blocks of the full layers, blocks of the windowed layers' own pool), the most sequences running in one
step, preemptions, the wall time and the generated tokens per second. ``--baseline DIR`` first runs this script
on the package in DIR (an earlier version), side by side in one run, and counts the requests whose greedy
outputs are the same in both.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder: its shared helpers
from baseline import run_on  # noqa: E402


def model_config(window: int, layers: int) -> dict:
    return {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 4096, "hidden_size": 256,
        "intermediate_size": 256, "head_dim": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_hidden_layers": layers, "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": window,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "max_position_embeddings": 16384, "rope_theta": 150000.0, "rms_norm_eps": 1e-5, "attention_bias": True,
        "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": 1,
    }


def run(args) -> dict:
    from dayzero import LLM, SamplingParams

    model = args.config
    if model is None:
        model = tempfile.mkdtemp(prefix="window_cache_")
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(model_config(args.window, args.layers), f)
    llm = LLM(model, device=args.device, dtype=args.dtype, load_format="dummy", cache_memory_bytes=args.cache_mib << 20,
              max_num_seqs=args.requests, max_model_len=args.prompt_len + args.decode + 16,
              max_num_batched_tokens=args.step_tokens)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 4000, (args.prompt_len,), generator=g).tolist()}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    peak, step = [0], eng.step

    def counted():
        out = step()
        peak[0] = max(peak[0], len(eng.scheduler.running))
        return out

    eng.step = counted
    preempted = eng.scheduler.num_preemptions
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    plan = eng.cache_plan
    window_pool = getattr(plan, "window_pool", None)
    return {
        "blocks": plan.num_blocks - 1, "window_blocks": window_pool[1] - 1 if window_pool else None,
        "block_size": plan.block_size, "peak_running": peak[0],
        "preemptions": eng.scheduler.num_preemptions - preempted, "wall_s": wall,
        "tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def run_baseline(args) -> dict | None:
    cmd = []
    for name in ("device", "dtype", "cache_mib", "requests", "prompt_len", "decode", "window", "layers", "step_tokens"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.config:
        cmd += ["--config", args.config]
    return run_on(__file__, cmd, args.baseline)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a checkpoint or config directory (default: a gpt-oss-shaped one)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-mib", type=int, default=64)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, metavar="DIR", help="an earlier version's package, run first")
    args = ap.parse_args()
    base = run_baseline(args) if args.baseline else None
    ours = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(ours, f)
        return
    rows = ([("baseline", base)] if base else []) + [("this version", ours)]
    print(f"{args.requests} requests of {args.prompt_len} + {args.decode} tokens, {args.cache_mib} MiB of cache, "
          f"window {args.window}, {args.device}")
    head = ["version", "full blocks", "window blocks", "peak running", "preemptions", "wall s", "tok/s"]
    print(" | ".join(head))
    for name, r in rows:
        print(" | ".join(str(x) for x in (name, r["blocks"], r["window_blocks"] or "-", r["peak_running"],
                                           r["preemptions"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.1f}")))
    if base:
        same = sum(a == b for a, b in zip(base["outputs"], ours["outputs"]))
        print(f"ratio: {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s, peak running "
              f"{base['peak_running']} -> {ours['peak_running']}; greedy outputs equal to the baseline's: "
              f"{same} of {len(ours['outputs'])}")


if __name__ == "__main__":
    main()
