"""Multi-turn conversations with the prefix cache on and off, side by side in one run.

    python benchmarks/multi_turn.py [--model MODEL] --device cpu --users 4 --turns 10
    python benchmarks/multi_turn.py --model configs/dayzero-small.json --load-format dummy --device cuda
    python benchmarks/multi_turn.py --device cpu --device-blocks 160 --num-snapshots 4   # + the host tier
    python benchmarks/multi_turn.py ... --baseline DIR   # and the same on an earlier package, side by side

Several users each hold a conversation of ``--turns`` turns that share one system prompt: turn t's prompt is
the system prompt, every earlier message and reply of that user, and a new message. All users send turn t at
once (one engine step loop), and each reply joins the history. Per setting: the prompt tokens the engine was
asked for and those it took from the prefix cache (hit rate), the prefill tokens it computed, TTFT (from
adding a request to its first token) at p50 / p90, and the total time. ``--device-blocks N`` adds two runs with
a device cache of only N blocks, without and with the prefix cache's host tier (``--host-cache-gib``), and
counts the blocks and snapshots that came back from host memory. The engines see the same token ids, and
each setting's replies are compared with the uncached run's (a reply that differs changes the user's later
prompts; on a model with near-flat logits in bf16, different step shapes alone can flip a greedy choice).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dayzero import LLM, SamplingParams


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def conversation(engine, users: list[list[int]], turns: int, gen: torch.Generator, msg: tuple[int, int],
                 reply: int, vocab: int) -> dict:
    eng = engine.engine
    ttft, asked, outputs = [], 0, []
    t0 = time.perf_counter()
    for _ in range(turns):
        start, first, ids, replies = {}, {}, {}, {}
        for u, history in enumerate(users):
            history += torch.randint(3, vocab, (int(torch.randint(msg[0], msg[1] + 1, (1,), generator=gen)),),
                                     generator=gen).tolist()
            rid = f"u{u}-{len(history)}"
            ids[rid] = u
            eng.add_request(rid, list(history), SamplingParams(max_tokens=reply, temperature=0.0, ignore_eos=True))
            start[rid] = time.perf_counter()
            asked += len(history)
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id not in first:
                    _sync(eng.device)
                    first[out.request_id] = time.perf_counter()
                if out.finished:
                    users[ids[out.request_id]] += out.outputs[0].token_ids
                    replies[out.request_id] = out.outputs[0].token_ids
        outputs += [replies[r] for r in start]  # in the users' order
        ttft += [first[r] - start[r] for r in start]
    _sync(eng.device)
    stats = eng.stats()
    return {"seconds": time.perf_counter() - t0, "asked_tokens": asked, "hit_tokens": stats["prefix_hit_tokens"],
            "ttft_p50_ms": 1e3 * statistics.median(ttft),
            "ttft_p90_ms": 1e3 * statistics.quantiles(ttft, n=10)[-1] if len(ttft) > 1 else 1e3 * ttft[0],
            "outputs": outputs}


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or config (default: the bundled model)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=256, help="tokens of the shared system prompt")
    ap.add_argument("--message-len", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--reply-len", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-blocks", type=int, default=None, metavar="N",
                    help="also run with a device cache of only N blocks, without and with the host tier")
    ap.add_argument("--num-snapshots", type=int, default=None, metavar="N", help="device state snapshots kept")
    ap.add_argument("--host-cache-gib", type=float, default=0.25, help="the host tier of the small-cache run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="also run the same settings on the dayzero package in DIR (an earlier version), side by side")
    args = ap.parse_args(argv)
    longest = args.system_len + args.turns * (args.message_len[1] + args.reply_len) + 1
    results = {}
    settings = [("off", dict(enable_prefix_caching=False)), ("on", {})]
    if args.device_blocks:
        settings += [("small", dict(num_cache_blocks=args.device_blocks)),
                     ("small+host", dict(num_cache_blocks=args.device_blocks, host_cache_gib=args.host_cache_gib))]
    for name, kw in settings:
        if args.num_snapshots is not None and kw.get("enable_prefix_caching", True):
            kw = {**kw, "num_prefix_snapshots": args.num_snapshots}
        llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                  max_num_seqs=args.users, max_model_len=longest, **kw)
        vocab = llm.engine.model_config.vocab_size
        gen = torch.Generator().manual_seed(args.seed)  # the same conversations for both
        system = torch.randint(3, vocab, (args.system_len,), generator=gen).tolist()
        users = [list(system) for _ in range(args.users)]
        print(f"prefix caching {name}: {args.users} users x {args.turns} turns ...", flush=True)
        results[name] = conversation(llm, users, args.turns, gen, tuple(args.message_len), args.reply_len, vocab)
        results[name]["device"] = str(llm.engine.device)
        u = llm.engine.cache_usage()
        results[name].update(blocks=llm.engine.cache_plan.num_blocks - 1, host_hit_blocks=u["host_hit_blocks"],
                             host_hit_snapshots=u["host_hit_snapshots"])
        del llm
    outs = {name: r.pop("outputs") for name, r in results.items()}
    for name, r in results.items():  # replies equal to the uncached run's (a reply that differs changes later prompts)
        r["same_replies"] = sum(a == b for a, b in zip(outs[name], outs["off"]))
        r["replies"] = len(outs[name])
    same = all(o == outs["off"] for o in outs.values())
    print(f"\n{args.users} users x {args.turns} turns, system prompt {args.system_len} tokens, messages "
          f"{args.message_len[0]}-{args.message_len[1]}, replies {args.reply_len}, on {results['on']['device']}; "
          f"greedy outputs equal: {same}")
    print(f"{'cache':>10} {'blocks':>7} {'asked tok':>10} {'from cache':>11} {'hit rate':>9} {'computed':>9} "
          f"{'from host':>10} {'TTFT p50 ms':>12} {'p90 ms':>8} {'total s':>8} {'replies as off':>15}")
    for name, r in results.items():
        host = f"{r['host_hit_blocks']}b/{r['host_hit_snapshots']}s" if name.endswith("host") else "-"
        print(f"{name:>10} {r['blocks']:>7} {r['asked_tokens']:>10} {r['hit_tokens']:>11} "
              f"{r['hit_tokens'] / r['asked_tokens']:>8.1%} {r['asked_tokens'] - r['hit_tokens']:>9} {host:>10} "
              f"{r['ttft_p50_ms']:>12.1f} {r['ttft_p90_ms']:>8.1f} {r['seconds']:>8.2f} "
              f"{r['same_replies']:>8} of {r['replies']}")
    on, off = results["on"], results["off"]
    if "small" in results and results["small"]["blocks"] >= on["blocks"]:
        print(f"note: --device-blocks {args.device_blocks} does not shrink the device cache (the engine's own is "
              f"{on['blocks']} blocks for {args.users} seats of {longest} tokens): only snapshots can run short")
    print(f"with the cache: {off['ttft_p50_ms'] / on['ttft_p50_ms']:.2f}x lower TTFT p50, "
          f"{off['seconds'] / on['seconds']:.2f}x faster in all")
    report = {"args": vars(args), "results": results, "greedy_equal": same}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.baseline:
        side_by_side(results, args, argv)
    return report


def side_by_side(results: dict, args, argv) -> None:
    """The same settings on an earlier package, in a new process, and each setting's times against it."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from baseline import run_on

    drop = ("--baseline", "--json")  # with their values
    rest = [a for i, a in enumerate(argv) if a not in drop and (i == 0 or argv[i - 1] not in drop)
            and not a.startswith(tuple(d + "=" for d in drop))]
    base = run_on(__file__, rest, args.baseline)
    if base is None:
        return
    print(f"\nside by side (same run): baseline ({args.baseline}) -> this version")
    print(f"{'cache':>10} {'TTFT p50 ms':>20} {'p90 ms':>20} {'total s':>18} {'ratio':>6} {'hit rate':>17}")
    for name, r in results.items():
        b = base["results"].get(name)
        if b is None:
            continue
        print(f"{name:>10} {b['ttft_p50_ms']:>9.1f} -> {r['ttft_p50_ms']:>7.1f} {b['ttft_p90_ms']:>9.1f} -> "
              f"{r['ttft_p90_ms']:>7.1f} {b['seconds']:>8.2f} -> {r['seconds']:>6.2f} "
              f"{b['seconds'] / r['seconds']:>5.2f}x "
              f"{b['hit_tokens'] / b['asked_tokens']:>7.1%} -> {r['hit_tokens'] / r['asked_tokens']:.1%}")


if __name__ == "__main__":
    main()
