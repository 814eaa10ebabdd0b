"""Distinct prompts that come back in the same order, more of them than the prefix cache keeps: the eviction
policies of its snapshots and blocks side by side in one run.

    python benchmarks/prompt_cycle.py --device cpu --prompts 48 --passes 4 --num-snapshots 16
    python benchmarks/prompt_cycle.py --device cpu --num-cache-blocks 300 --num-snapshots 64   # blocks run short

Each pass sends every prompt once, ``--max-num-seqs`` at a time in the same order (an evaluation harness
rerunning its set, a fleet of agents with fixed instructions polled in turn). With least-recently-used eviction
a cycle longer than the pool finds each snapshot (or block) evicted just before its prompt comes back; the
adaptive policy (``dayzero.cache.eviction``) notices that bimodal insertion would have resumed more and keeps
part of the cycle. Per setting: prompt tokens taken from the cache in each pass, TTFT p50 and the total time;
greedy outputs are checked to be equal to the uncached run's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dayzero import LLM, SamplingParams


def run(llm: LLM, prompts: list[list[int]], passes: int, reply: int) -> dict:
    eng = llm.engine
    hits, ttft, outputs = [], [], []
    t0 = time.perf_counter()
    for p in range(passes):
        before, start, first = eng.stats()["prefix_hit_tokens"], {}, {}
        for i, prompt in enumerate(prompts):
            eng.add_request(f"{p}-{i}", prompt, SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True))
            start[f"{p}-{i}"] = time.perf_counter()
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                first.setdefault(out.request_id, time.perf_counter())
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outputs += [done[f"{p}-{i}"] for i in range(len(prompts))]
        ttft += [first[r] - start[r] for r in start]
        hits.append(eng.stats()["prefix_hit_tokens"] - before)
    return {"seconds": time.perf_counter() - t0, "hit_tokens": hits, "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "snapshots_evicted": eng.cache.snapshots.num_evicted, "blocks_evicted": eng.cache.blocks.num_evicted,
            "outputs": outputs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config (default: the bundled model)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=48, help="distinct prompts in the cycle")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[96, 192], metavar=("MIN", "MAX"))
    ap.add_argument("--passes", type=int, default=4)
    ap.add_argument("--reply-len", type=int, default=8)
    ap.add_argument("--num-snapshots", type=int, default=16, help="device state snapshots kept")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--num-cache-blocks", type=int, default=None,
                    help="device blocks (default: enough for every prompt's, so only the snapshots run short)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    settings = {"off": dict(enable_prefix_caching=False),
                "lru": dict(prefix_eviction_policy="lru", num_prefix_snapshots=args.num_snapshots),
                "adaptive": dict(prefix_eviction_policy="adaptive", num_prefix_snapshots=args.num_snapshots)}
    results, asked = {}, 0
    longest = args.prompt_len[1] + args.reply_len + 1
    # the blocks the engine would cap at (max_num_seqs sequences) keep only the last few prompts' prefixes
    blocks = args.num_cache_blocks or 1 + (args.prompts + args.max_num_seqs) * -(-longest // 16)
    for name, kw in settings.items():
        llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, block_size=16,
                  num_cache_blocks=blocks, max_num_seqs=args.max_num_seqs, max_model_len=longest, **kw)
        gen = torch.Generator().manual_seed(args.seed)  # the same prompts for every setting
        vocab = llm.engine.model_config.vocab_size
        lengths = torch.randint(args.prompt_len[0], args.prompt_len[1] + 1, (args.prompts,), generator=gen).tolist()
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        asked = sum(lengths)
        print(f"{name}: {args.prompts} prompts x {args.passes} passes ...", flush=True)
        results[name] = run(llm, prompts, args.passes, args.reply_len)
        results[name]["device"] = str(llm.engine.device)
        del llm
    same = all(r["outputs"] == results["off"]["outputs"] for r in results.values())
    for r in results.values():
        r.pop("outputs")
    print(f"\n{args.prompts} prompts of {args.prompt_len[0]}-{args.prompt_len[1]} tokens ({asked} a pass) x "
          f"{args.passes} passes, {args.num_snapshots} snapshots, {blocks} blocks of 16, on "
          f"{results['off']['device']}; greedy outputs "
          f"equal: {same}")
    print(f"{'policy':>9} " + " ".join(f"{f'pass {p + 1} hit':>11}" for p in range(args.passes))
          + f" {'all passes':>11} {'snapshots evicted':>17} {'blocks evicted':>14} {'TTFT p50 ms':>12} {'total s':>8}")
    for name, r in results.items():
        print(f"{name:>9} " + " ".join(f"{h / asked:>11.1%}" for h in r["hit_tokens"])
              + f" {sum(r['hit_tokens']) / (asked * args.passes):>11.1%} {r['snapshots_evicted']:>17}"
              f" {r['blocks_evicted']:>14}"
              f" {r['ttft_p50_ms']:>12.1f} {r['seconds']:>8.2f}")
    report = {"args": vars(args), "results": results, "greedy_equal": same}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
