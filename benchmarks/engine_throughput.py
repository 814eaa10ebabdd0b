"""Offline engine throughput: prefill and decode tokens/s through the real engine path, with a roofline.

    python benchmarks/engine_throughput.py --config configs/dayzero-small.json --device cuda \
        --batch 1 8 32 --prompt-len 512 --decode 32

Random weights from the config (``load_format="dummy"``). For each batch size it prefills ``batch`` prompts
of ``--prompt-len`` tokens, then decodes ``--decode`` steps, timing each phase with the device synchronised.
The roofline for decode is the bytes a step must move (weights read once, activated experts only, plus
the KV/state bytes read) over the measured copy bandwidth; for prefill, FLOPs (2 × active parameters per
token) over the measured matmul rate. Prints a table; ``--json FILE`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from dayzero import LLM, SamplingParams
from dayzero.config.spec import MoESpec


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


def active_params(model, spec) -> tuple[int, int]:
    """(total parameters, parameters one token touches)."""
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for layer, ls in zip(model.model.layers, spec.layers):
        if isinstance(ls.mlp, MoESpec):
            routed = sum(getattr(layer.mlp, n).numel() for n in ("w1", "w2") if hasattr(layer.mlp, n))
            inactive += routed * (1 - ls.mlp.top_k / ls.mlp.n_experts)
    return total, int(total - inactive - model.model.embed_tokens.weight.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-small.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(args.config, device=args.device, dtype=args.dtype, load_format="dummy", max_num_seqs=max(args.batch),
              max_num_batched_tokens=max(args.batch) * args.prompt_len, max_model_len=args.prompt_len + args.decode + 1)
    eng = llm.engine
    dev, spec = eng.device, eng.model_config
    total, active = active_params(eng.model, spec)
    bw, flops = measured_ceilings(dev)
    elem = eng.dtype.itemsize
    print(f"{args.config}: {total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active per token, embeddings aside) "
          f"on {dev} in {str(eng.dtype).removeprefix('torch.')}; built in {time.perf_counter() - t0:.1f}s; "
          f"measured copy {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.1f} TFLOP/s")
    rows = []
    g = torch.Generator().manual_seed(0)
    for bsz in args.batch:
        prompts = [{"prompt_token_ids": torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=g).tolist()} for _ in range(bsz)]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        _sync(dev)
        t = time.perf_counter()
        llm.generate(prompts, one)
        _sync(dev)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=1 + args.decode, temperature=0.0, ignore_eos=True))
        _sync(dev)
        decode_s = max(time.perf_counter() - t - prefill_s, 1e-9)
        step_bytes = active * elem + bsz * args.prompt_len * sum(
            s.bytes_per_token() for s in eng.runner.specs if hasattr(s, "rows"))
        rows.append({
            "batch": bsz, "prefill_tok_s": bsz * args.prompt_len / prefill_s, "decode_tok_s": bsz * args.decode / decode_s,
            "decode_step_ms": 1e3 * decode_s / args.decode,
            "decode_roofline_ms": 1e3 * step_bytes / bw,
            "prefill_roofline_tok_s": flops / (2 * active),
        })
    print(f"{'batch':>5} {'prefill tok/s':>14} {'roofline':>10} {'decode tok/s':>13} {'step ms':>9} {'roofline ms':>12} {'of roofline':>12}")
    for r in rows:
        print(f"{r['batch']:>5} {r['prefill_tok_s']:>14.0f} {r['prefill_roofline_tok_s']:>10.0f} {r['decode_tok_s']:>13.1f} "
              f"{r['decode_step_ms']:>9.1f} {r['decode_roofline_ms']:>12.2f} {r['decode_roofline_ms'] / r['decode_step_ms']:>11.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "device": str(dev), "bandwidth": bw, "flops": flops, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
