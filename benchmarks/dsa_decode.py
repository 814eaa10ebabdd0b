"""One DSA layer's attention decode step: lightning-indexer scores + top-k + sparse absorbed MLA (Triton), against
dense MLA over the whole context (the same Triton kernel, no selection) and the old PyTorch decode paths, side
by side in one run, with the roofline; then a long prefill: the indexer's varlen form in bounded chunks, and
sparse MLA for the prompt's last chunk of rows.

    python benchmarks/dsa_decode.py --config configs/dayzero-2.8t.json --contexts 8192 32768 131072 --batch 1 8
    python benchmarks/dsa_decode.py --device cpu --small      # smoke test through Triton's interpreter

Shapes (H, R, P, N, V, Hi, Di, top-k) come from the config; bf16 pools (``--cache fp8`` / ``int8``: the decode
pools quantised as an FP8 / INT8 KV cache stores them, codes and a scale a row), every sequence ``context`` tokens long,
its blocks scattered at random over the pool. Each implementation runs ``--repeats`` times after a warm-up,
timed with CUDA events. The roofline of a step is the bytes it must read over the copy bandwidth measured in
the same run: the indexer reads every key whole (Di x 2 B a key), sparse MLA only the selected latent rows
((R+P) x 2 B each), dense MLA every latent row of the context.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_argv = " ".join(sys.argv[1:]).replace("=", " ").split()
if any(a == "--device" and b == "cpu" for a, b in zip(_argv, _argv[1:])):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported, so before dayzero

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from benchmarks.timing import copy_bandwidth, ms_per_call, ms_per_replay  # noqa: E402
from dayzero.engine.batch import ForwardBatch  # noqa: E402
from dayzero.ops.attention import cuda as attn  # noqa: E402
from dayzero.ops.indexer import cuda as idx  # noqa: E402
from dayzero.ops.indexer import triton_indexer  # noqa: E402

SMALL = {"num_attention_heads": 4, "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
         "v_head_dim": 16, "index_n_heads": 4, "index_head_dim": 32, "index_topk": 16}


def decode_batch(B: int, context: int, bs: int, device: str, g: torch.Generator) -> ForwardBatch:
    """B sequences of ``context`` tokens (the last one is this step's query), blocks scattered over the pool."""
    per = -(-context // bs)
    tables = (torch.randperm(B * per, generator=g) + 1).view(B, per).to(device)  # block 0 is the null block
    pos = torch.full((B,), context - 1, dtype=torch.int64, device=device)
    slots = tables[:, -1] * bs + (context - 1) % bs
    rows = torch.arange(B, device=device)
    return ForwardBatch(torch.zeros(B, dtype=torch.int64, device=device), pos, list(range(B + 1)), [context - 1] * B,
                        [context] * B, slots, tables, rows, rows, bs)


def quantised(pool: torch.Tensor, kind: str):
    """A bf16 pool [num_blocks, block_size, width] as the cache would store it with ``kv_cache_dtype`` ``kind``:
    the pool itself for bf16, else fp8 / int8 codes with one scale per row (``QuantPagedPool``), filled block
    by block (no whole-pool fp32 temporary)."""
    if kind == "bf16":
        return pool
    from dayzero.cache.quant import QuantPagedPool
    nb, bs, width = pool.shape
    q = QuantPagedPool(nb, bs, (width,), kind, False, pool.device, pool.dtype)
    for b0 in range(0, nb, 4096):
        rows = pool[b0:b0 + 4096].float()
        s = q._scale_of(rows.abs().amax(-1))
        q.data[b0:b0 + 4096] = q._quant(rows, s[..., None])
        q.scale[b0:b0 + 4096] = s.to(q.scale.dtype)
    return q


def row_bytes(width: int, kind: str) -> int:
    """Bytes the kernels read for one pool row: bf16 values, or one-byte codes and a bf16 scale."""
    return 2 * width if kind == "bf16" else width + 2


def shapes(args) -> dict:
    with open(args.config) as f:
        cfg = json.load(f)
    if args.small:
        cfg.update(SMALL)
    return {"H": cfg["num_attention_heads"], "R": cfg["kv_lora_rank"], "P": cfg["qk_rope_head_dim"],
            "N": cfg["qk_nope_head_dim"], "V": cfg["v_head_dim"], "Hi": cfg["index_n_heads"],
            "Di": cfg["index_head_dim"], "topk": cfg["index_topk"]}


def bench_decode(s: dict, B: int, context: int, args, bw: float, g: torch.Generator) -> dict:
    dev, bs, topk, bf16 = args.device, args.block_size, s["topk"], torch.bfloat16
    batch = decode_batch(B, context, bs, dev, g)
    nb = int(batch.block_tables.shape[0] * batch.block_tables.shape[1]) + 1
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(bf16).to(dev)  # noqa: E731
    k_pool = quantised(rnd(nb, bs, s["Di"]), args.cache)
    lat_pool = quantised(rnd(nb, bs, s["R"] + s["P"]), args.cache)
    q, w = rnd(B, s["Hi"], s["Di"]), (torch.randn(B, s["Hi"], generator=g) * (s["Hi"] * s["Di"]) ** -0.5).to(dev)
    qn, qp = rnd(B, s["H"], s["N"]), rnd(B, s["H"], s["P"])
    kv_b = rnd(s["H"] * (s["N"] + s["V"]), s["R"], scale=s["R"] ** -0.5)
    sink, scale = None, (s["N"] + s["P"]) ** -0.5
    sel = torch.empty(B, topk, dtype=torch.int64, device=dev)
    scores = torch.empty(B, batch.key_width, dtype=torch.float32, device=dev)
    r = args.repeats

    def mla(selection, torch_path=False):
        fn = attn.paged_mla_decode_torch if torch_path else attn.paged_mla_rows
        return fn(qn, qp, lat_pool, kv_b, s["V"], batch, scale, sink, selection)

    t = {
        "scores": ms_per_call(lambda: triton_indexer.decode_scores(q, w, k_pool, batch.block_tables, batch.positions, bs,
                                                            scores), r, dev),
        "topk": ms_per_call(lambda: triton_indexer.topk_of_scores(scores, batch.positions, topk, sel), r, dev),
        # the same selection as one torch.topk over each whole row (what long rows took before the two stages)
        "topk_one_stage": ms_per_call(lambda: torch.topk(scores, min(topk, scores.shape[1]), dim=-1), r, dev),
        "indexer": ms_per_call(lambda: idx.paged_indexer_topk_decode(q, w, k_pool, batch, topk, sel), r, dev),
        "sparse_mla": ms_per_call(lambda: mla(sel), r, dev),
        "dense_mla": ms_per_call(lambda: mla(None), r, dev),
    }
    t["step"] = ms_per_call(lambda: (idx.paged_indexer_topk_decode(q, w, k_pool, batch, topk, sel), mla(sel)), r, dev)
    t["torch_step"] = ms_per_call(lambda: (idx.paged_indexer_topk_decode_torch(q, w, k_pool, batch, topk, sel),
                                     mla(sel, True)), r, dev)
    t["torch_dense"] = ms_per_call(lambda: mla(None, True), r, dev)
    if dev == "cuda":  # the same calls replayed from CUDA graphs, as the engine's decode steps run them
        t["graph"] = {
            "step": ms_per_replay(lambda: (idx.paged_indexer_topk_decode(q, w, k_pool, batch, topk, sel), mla(sel)), r),
            "indexer": ms_per_replay(lambda: idx.paged_indexer_topk_decode(q, w, k_pool, batch, topk, sel), r),
            "dense_mla": ms_per_replay(lambda: mla(None), r),
            "torch_step": ms_per_replay(lambda: (idx.paged_indexer_topk_decode_torch(q, w, k_pool, batch, topk, sel),
                                                 mla(sel, True)), r),
        }
    keys = min(topk, context)
    key, lat = row_bytes(s["Di"], args.cache), row_bytes(s["R"] + s["P"], args.cache)
    bytes_ = {"indexer": B * context * key, "sparse_mla": B * keys * lat, "dense_mla": B * context * lat}
    roof = {k: v / bw * 1e3 for k, v in bytes_.items()}
    return {"batch": B, "context": context, "ms": t, "bytes": bytes_, "roofline_ms": roof,
            "step_roofline_ms": roof["indexer"] + roof["sparse_mla"]}


def bench_prefill(s: dict, tokens: int, args, g: torch.Generator) -> dict:
    """The indexer's varlen form over one ``tokens``-long prompt: scores in chunks under the scratch budget."""
    dev, bs, topk = args.device, args.block_size, s["topk"]
    batch = decode_batch(1, tokens, bs, dev, g)
    nb = int(batch.block_tables.numel()) + 1
    k_pool = torch.randn(nb, bs, s["Di"], generator=g).to(torch.bfloat16).to(dev)
    q = torch.randn(tokens, s["Hi"], s["Di"], generator=g).to(torch.bfloat16).to(dev)
    w = (torch.randn(tokens, s["Hi"], generator=g) * (s["Hi"] * s["Di"]) ** -0.5).to(dev)
    seq = torch.zeros(tokens, dtype=torch.int64, device=dev)
    pos = torch.arange(tokens, device=dev)
    out = torch.empty(tokens, topk, dtype=torch.int64, device=dev)
    budget = args.budget or (triton_indexer.SCRATCH_BUDGET if not args.small else 1 << 14)
    run = lambda: triton_indexer.varlen_topk(q, w, k_pool, batch.block_tables, seq, pos, bs, topk, out,  # noqa: E731
                                             budget=budget)
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = ms_per_call(run, 1, dev)  # the warm-up call compiles; one timed call
    peak = torch.cuda.max_memory_allocated() - base if dev == "cuda" else None
    kw = batch.key_width
    rows = triton_indexer.chunk_rows(kw, topk, budget)
    flops = tokens * (tokens + 1) / 2 * s["Hi"] * s["Di"] * 2  # causal pairs x heads x 2 Di
    return {"tokens": tokens, "ms": ms, "chunks": -(-tokens // rows), "rows_per_chunk": rows,
            "scratch_bytes": triton_indexer.scratch_bytes(tokens, kw, topk, budget), "budget": budget,
            "peak_extra_bytes": peak, "causal_tflops": flops / (ms * 1e-3) / 1e12,
            "mla": bench_prefill_mla(s, batch, out, min(tokens, args.prefill_chunk), args, g)}


def bench_prefill_mla(s: dict, prompt: ForwardBatch, selection: torch.Tensor, C: int, args, g) -> dict:
    """Sparse absorbed MLA for the last ``C``-row chunk of the prompt (the engine prefills a long prompt in chunks
    of ``max_num_batched_tokens``), each row over its own selected keys, through ``paged_mla``'s device path."""
    dev, bs, bf16 = args.device, args.block_size, torch.bfloat16
    T = prompt.plan.seq_lens[0]
    rows = torch.arange(T - C, T, device=dev)
    chunk = ForwardBatch(torch.zeros(C, dtype=torch.int64, device=dev), rows, [0, C], [T - C], [T],
                         torch.zeros(C, dtype=torch.int64, device=dev), prompt.block_tables,
                         torch.zeros(1, dtype=torch.int64, device=dev), torch.tensor([C - 1], device=dev), bs)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(bf16).to(dev)  # noqa: E731
    lat = rnd(int(prompt.block_tables.numel()) + 1, bs, s["R"] + s["P"])
    qn, qp = rnd(C, s["H"], s["N"]), rnd(C, s["H"], s["P"])
    kv_b = rnd(s["H"] * (s["N"] + s["V"]), s["R"], scale=s["R"] ** -0.5)
    sel = selection[T - C:]
    run = lambda: attn.paged_mla_rows(qn, qp, lat, kv_b, s["V"], chunk, (s["N"] + s["P"]) ** -0.5, None, sel)  # noqa: E731
    if dev == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    ms = ms_per_call(run, 1, dev)
    peak = torch.cuda.max_memory_allocated() - base if dev == "cuda" else None
    keys = (sel >= 0).sum().item()
    flops = keys * s["H"] * (2 * s["R"] + s["P"]) * 2  # scores over R+P, the weighted sum over R, per selected key
    return {"rows": C, "ms": ms, "selected_keys": keys, "tflops": flops / (ms * 1e-3) / 1e12, "peak_extra_bytes": peak}


def print_graphed(rows: list[dict]) -> None:
    """The decode table again, from the CUDA-graph replays."""
    graphed = [r for r in rows if "graph" in r["ms"]]
    if not graphed:
        return
    print("\nthe same, replayed from CUDA graphs (ms; sparse / dense = dense MLA time over the sparse step's)")
    print(f"{'ctx':>7} {'B':>3} | {'indexer':>8} {'step':>7} {'idx %':>6} {'of roof':>7} | {'dense':>7} "
          f"{'of roof':>7} | {'sparse / dense':>14} {'physical':>8} | {'torch step':>10} {'speedup':>7}")
    for r in graphed:
        g_, roof = r["ms"]["graph"], r["roofline_ms"]
        fmt = lambda v, w=7: f"{v:>{w}.3f}" if v else f"{'-':>{w}}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        pct = lambda a, b: f"{a / b:.0%}" if a and b else "-"  # noqa: E731
        print(f"{r['context']:>7} {r['batch']:>3} | {fmt(g_['indexer'], 8)} {fmt(g_['step'])} "
              f"{pct(g_['indexer'], g_['step']):>6} "
              f"{pct(r['step_roofline_ms'], g_['step']):>7} | {fmt(g_['dense_mla'])} "
              f"{pct(roof['dense_mla'], g_['dense_mla']):>7} | {ratio(g_['dense_mla'], g_['step']):>14} "
              f"{roof['dense_mla'] / r['step_roofline_ms']:>7.2f}x | {fmt(g_['torch_step'], 10)} "
              f"{ratio(g_['torch_step'], g_['step']):>7}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/dayzero-2.8t.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=None, help="0: skip the prefill timing")
    ap.add_argument("--budget", type=int, default=None, help="varlen scratch budget in bytes")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="rows of the sparse MLA prefill chunk timed")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shapes and contexts (a smoke test)")
    ap.add_argument("--cache", default="bf16", choices=["bf16", "fp8", "int8"],
                    help="the decode pools' storage (kv_cache_dtype; fp8 / int8: codes and one scale a row)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.contexts = args.contexts or [40, 100]
        args.batch, args.block_size, args.repeats = [b for b in args.batch if b <= 2] or [1], 16, min(args.repeats, 2)
        args.prefill_tokens = 96 if args.prefill_tokens is None else args.prefill_tokens
    args.contexts = args.contexts or [8192, 32768, 131072]
    args.prefill_tokens = 131072 if args.prefill_tokens is None else args.prefill_tokens
    s = shapes(args)
    g = torch.Generator().manual_seed(0)
    bw = copy_bandwidth(args.device)
    print(f"{args.config}{' (small)' if args.small else ''}: H {s['H']}, R {s['R']}, P {s['P']}, Hi {s['Hi']}, "
          f"Di {s['Di']}, top-{s['topk']}, block {args.block_size}, bf16, {args.cache} decode pools; copy bandwidth "
          f"{bw / 1e9:.0f} GB/s")
    head = (f"{'ctx':>7} {'B':>3} | {'scores':>7} {'topk':>7} {'1-stage':>7} {'indexer':>8} {'sparse':>7} {'step':>7} {'idx %':>6} "
            f"{'roof':>7} {'of roof':>7} | {'dense':>7} {'roof':>7} {'of roof':>7} | {'torch step':>10} "
            f"{'torch dense':>11} {'speedup':>7}")
    print("decode step, ms (indexer = scores + top-k; 1-stage: one torch.topk per row instead of the two stages "
          "long rows take; step = indexer + sparse MLA; roof = bytes / copy bandwidth)")
    print(head)
    rows = []
    for context in args.contexts:
        for B in args.batch:
            r = bench_decode(s, B, context, args, bw, g)
            t, roof = r["ms"], r["roofline_ms"]
            print(f"{context:>7} {B:>3} | {t['scores']:>7.3f} {t['topk']:>7.3f} {t['topk_one_stage']:>7.3f} "
                  f"{t['indexer']:>8.3f} "
                  f"{t['sparse_mla']:>7.3f} {t['step']:>7.3f} {t['indexer'] / t['step']:>6.0%} "
                  f"{r['step_roofline_ms']:>7.3f} {r['step_roofline_ms'] / t['step']:>7.0%} | {t['dense_mla']:>7.3f} "
                  f"{roof['dense_mla']:>7.3f} {roof['dense_mla'] / t['dense_mla']:>7.0%} | {t['torch_step']:>10.3f} "
                  f"{t['torch_dense']:>11.3f} {t['torch_step'] / t['step']:>6.1f}x")
            rows.append(r)
    print_graphed(rows)
    result = {"args": vars(args), "shapes": s, "bandwidth": bw, "decode": rows}
    if args.prefill_tokens:
        p = bench_prefill(s, args.prefill_tokens, args, g)
        peak = "" if p["peak_extra_bytes"] is None else f", peak extra memory {p['peak_extra_bytes'] / 2**20:.0f} MiB"
        print(f"indexer prefill (varlen) of {p['tokens']} tokens: {p['ms']:.1f} ms in {p['chunks']} chunks of "
              f"{p['rows_per_chunk']} rows, scratch {p['scratch_bytes'] / 2**20:.2f} MiB (budget "
              f"{p['budget'] / 2**20:.2f} MiB){peak}, {p['causal_tflops']:.1f} causal TFLOP/s")
        m = p["mla"]
        peak = "" if m["peak_extra_bytes"] is None else f", peak extra memory {m['peak_extra_bytes'] / 2**20:.0f} MiB"
        print(f"sparse MLA prefill chunk of {m['rows']} rows at the end of it: {m['ms']:.1f} ms, "
              f"{m['selected_keys'] / m['rows']:.0f} keys a row, {m['tflops']:.1f} TFLOP/s{peak}")
        result["prefill"] = p
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
