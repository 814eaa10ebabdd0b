"""One MoE expert layer (``moe_experts_grouped``) in every weight format, 1 to 8192 tokens, against the bf16 matmul
peak and the copy bandwidth measured in the same run.

    python benchmarks/moe_layer.py                                    # E 64 and 256, L:I 4096:2048 and 7168:2048
    python benchmarks/moe_layer.py --experts 64 --shapes 4096:2048 --tokens 1 64 4096 --json out.json
    python benchmarks/moe_layer.py --tune --experts 64 --shapes 4096:2048   # writes the kernels' tuning table
    TRITON_INTERPRET=1 python benchmarks/moe_layer.py --device cpu --small  # smoke test on a CPU

Each token goes to top-k experts drawn uniformly at random (fixed seed); rows = tokens x k, sorted by expert
(``moe_permute``). Weights are random MXFP4 codes, and the other formats hold the same values: bf16 (dequantised),
FP8 ``BlockScaled`` (E2M1 codes are exact in e4m3), packed ``PackedMXFP4`` read by the kernels (``fused``).
Variants: ``triton-bf16``, ``grouped_mm-bf16`` (torch, where it runs), ``triton-fp8`` (BlockScaled),
``triton-fp8tile`` / ``-fp8tile-a8`` (DeepSeek's 128x128-tile FP8; a8: FP8 activations, FP8 x FP8 dots),
``triton-mxfp4`` (fused), ``convert`` (``ExpertWorkspace`` converting one layer MXFP4 -> FP8, timed alone) and
``reference`` (the per-expert loop, small token counts only); for steps of at most ``direct_max_pairs`` pairs
also the whole routed op (expert outputs weighted and summed per token): ``direct-bf16`` / ``-fp8`` / ``-mxfp4``
(the unsorted kernels) beside ``sorted-bf16`` (sort, grouped kernels, weighted gather). Columns: time, TFLOP/s and % of the bf16 matmul
peak (2 x rows x L x I x 3 FLOPs, gated SiLU), GB/s of expert weights read (the experts hit, in the variant's
format; for ``convert`` packed read + FP8 written) and % of the copy bandwidth. CUDA events, after a warm-up.

``--tune`` times a small grid of (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per format and row bucket
(first the first kernel's, then the second's) and merges the best into ``triton_moe_configs.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for benchmarks.* below
from benchmarks.timing import ceilings, fp8_matmul_rate, timer  # noqa: E402

FORMATS = ("triton-bf16", "grouped_mm-bf16", "triton-fp8", "triton-mxfp4", "convert", "reference", "direct-bf16",
           "direct-fp8", "direct-mxfp4", "sorted-bf16", "triton-fp8tile", "triton-fp8tile-a8", "direct-fp8tile",
           "direct-fp8tile-a8")
TILE_BYTES = 1 + 4 / 128**2
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1 + 4 / 32, "mxfp4": 0.5 + 1 / 32, "fp8_tile": TILE_BYTES, "fp8_tile_a8": TILE_BYTES}


def layer(E: int, L: int, I: int, device: str, seed: int = 0):
    """Random MXFP4 experts (w1 [E, 2I, L], w2 [E, L, I]) and the same values as bf16 and BlockScaled FP8; the
    bf16 values quantised to DeepSeek's 128x128-tile FP8 (``TileScaled``, without and with FP8 activations)."""
    from dayzero.quant.fp8 import TileScaled, quantize_fp8_blocks
    from dayzero.quant.mxfp4 import dequantize_mxfp4
    from dayzero.quant.workspace import BlockScaled, PackedMXFP4

    g = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, (n, k) in (("w1", (2 * I, L)), ("w2", (L, I))):
        blocks = torch.randint(0, 256, (E, n, k // 32, 16), generator=g, device=device, dtype=torch.uint8)
        scales = torch.randint(118, 122, (E, n, k // 32), generator=g, device=device, dtype=torch.uint8)
        bf16 = torch.empty(E, n, k, dtype=torch.bfloat16, device=device)
        fp8 = torch.empty(E, n, k, dtype=torch.float8_e4m3fn, device=device)
        for e in range(E):  # per expert: the dequantisation's fp32 temporaries stay small
            bf16[e] = dequantize_mxfp4(blocks[e], scales[e], torch.bfloat16)
            fp8[e] = dequantize_mxfp4(blocks[e], torch.full_like(scales[e], 127), torch.float32).to(fp8.dtype)
        scale = torch.exp2(scales.float() - 127)
        tile8, tile_s = torch.empty_like(fp8), torch.empty(E, -(-n // 128), -(-k // 128), device=device)
        for e in range(E):
            tile8[e], tile_s[e] = quantize_fp8_blocks(bf16[e])
        out[name] = {"bf16": bf16, "fp8": BlockScaled(fp8, scale), "mxfp4": PackedMXFP4(blocks, scales),
                     "fp8_tile": TileScaled(tile8, tile_s), "fp8_tile_a8": TileScaled(tile8, tile_s, fp8_activations=True)}
    return out


def routed_rows(T: int, E: int, k: int, L: int, device: str, seed: int):
    from dayzero.ops.moe.reference import permute

    g = torch.Generator(device).manual_seed(seed)
    ids = torch.rand(T, E, generator=g, device=device).topk(k, dim=-1).indices  # k distinct experts per token
    order, offsets = permute(ids, E)
    x = torch.randn(T, L, generator=g, device=device).to(torch.bfloat16)
    weights = torch.rand(T, k, generator=g, device=device)
    return x[order // k], offsets, int(ids.unique().numel()), (x, ids, weights)


def whole_op_variants(w, routing, formats) -> dict:
    """The whole routed op (the tokens' k experts, weighted and summed) for few pairs: ``direct-*`` (the unsorted
    kernels) and ``sorted-bf16`` (sort, the grouped kernels, the weighted gather), side by side."""
    from dayzero.ops.moe import cuda as moe_cuda
    from dayzero.ops.moe import direct_kernels as D
    from dayzero.ops.moe import permute_kernels

    x, ids, weights = routing
    out = {}
    for name, fmt in (("direct-bf16", "bf16"), ("direct-fp8", "fp8"), ("direct-mxfp4", "mxfp4"),
                      ("direct-fp8tile", "fp8_tile"), ("direct-fp8tile-a8", "fp8_tile_a8")):
        w1, w2 = w["w1"][fmt], w["w2"][fmt]
        if name in formats and D.refusal(x, ids, weights, w1, w2) is None:
            out[name] = fmt, lambda w1=w1, w2=w2: D.moe_experts_direct(x, ids, weights, w1, w2)
    w1, w2 = w["w1"]["bf16"], w["w2"]["bf16"]
    if "sorted-bf16" in formats and out and permute_kernels.refusal(ids, w1.shape[0]) is None:
        out["sorted-bf16"] = "bf16", lambda: moe_cuda.sorted_experts(x, ids, weights, w1, w2)
    return out


def variants(w, xs, offsets, formats, ref_ok: bool, routing=None):
    """name -> (format of the weights read, fn) for the variants that can run these rows."""
    from dayzero.ops.moe import cuda as moe_cuda
    from dayzero.ops.moe import reference
    from dayzero.ops.moe import triton_moe as T

    out = whole_op_variants(w, routing, formats) if routing is not None else {}
    for name, fmt in (("triton-bf16", "bf16"), ("triton-fp8", "fp8"), ("triton-mxfp4", "mxfp4"),
                      ("triton-fp8tile", "fp8_tile"), ("triton-fp8tile-a8", "fp8_tile_a8")):
        w1, w2 = w["w1"][fmt], w["w2"][fmt]
        if name in formats and T.refusal(xs, offsets, w1, w2) is None:
            out[name] = fmt, lambda w1=w1, w2=w2: T.moe_experts_grouped(xs, offsets, w1, w2)
    w1, w2 = w["w1"]["bf16"], w["w2"]["bf16"]
    if "grouped_mm-bf16" in formats and moe_cuda.grouped_mm_refusal(xs, w1, w2) is None:
        out["grouped_mm-bf16"] = "bf16", lambda: moe_cuda.grouped_mm_mlp(xs, offsets, w1, w2)
    if "reference" in formats and ref_ok:
        out["reference"] = "bf16", lambda: reference.grouped_mlp(xs, offsets, w1, w2)
    return out


def convert_fn(w, device: str):
    """One layer's MXFP4 -> FP8 workspace conversion, as the engine runs it (slot reuse, no cache)."""
    from dayzero.quant.workspace import ExpertWorkspace

    ws = ExpertWorkspace("fp8", device, slots=1)
    mx1, mx2 = w["w1"]["mxfp4"], w["w2"]["mxfp4"]
    moe = SimpleNamespace(w1_blocks=mx1.blocks, w1_scales=mx1.scales, w2_blocks=mx2.blocks, w2_scales=mx2.scales)
    return lambda: (ws.invalidate(), ws.acquire(moe))


def tune_grid(rows: int, E: int, small: bool, fp8: bool = False):
    """Candidate kernel configs: row tiles near the rows per expert, a few (BLOCK_N, BLOCK_K, warps, stages)."""
    from dayzero.ops.moe import triton_moe as T
    from dayzero.ops.triton_support import next_pow2

    top = max(16, 2 * next_pow2(-(-rows // E)))
    bms = [b for b in (16, 32, 64, 128) if b <= top][-2:]
    rest = [(64, 128, 4, 4), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 4)]
    if fp8:  # FP8 x FP8 dots: K steps are 128 (one activation group) whatever is asked; wider and deeper tiles
        rest = [(64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 8, 5)]
    return [T.KernelConfig(bm, *r) for bm in bms for r in (rest[:2] if small else rest)]


def tune(args, w, E, L, I, timed, table: dict) -> None:
    """Coordinate descent per format and token count: best first-kernel config, then best second-kernel one."""
    from dayzero.ops.moe import triton_moe as T

    for fmt in args.tune_formats:
        w1, w2 = w["w1"][fmt], w["w2"][fmt]
        entry = table.setdefault(T.table_key(T.format_key(w1, w2), E, L, I), {})
        for tokens in args.tokens:
            xs, offsets, _, _ = routed_rows(tokens, E, args.top_k, L, args.device, seed=tokens)
            if T.refusal(xs, offsets, w1, w2) is not None:
                continue
            best = T.default_config(xs.shape[0], E)
            for part in ("up", "down"):
                scores = []
                for c in tune_grid(xs.shape[0], E, args.small, fmt == "fp8_tile_a8"):
                    cfg = T.Config(c, best.down) if part == "up" else T.Config(best.up, c)
                    try:
                        scores.append((timed(lambda: T.moe_experts_grouped(xs, offsets, w1, w2, config=cfg)), cfg))
                    except Exception as exc:  # out of shared memory / registers: not a candidate here
                        print(f"  skip {c}: {type(exc).__name__}")
                best = min(scores, key=lambda s: s[0])[1] if scores else best
            ms = timed(lambda: T.moe_experts_grouped(xs, offsets, w1, w2, config=best))
            entry[str(T.row_bucket(xs.shape[0]))] = {k: list(vars(getattr(best, k)).values()) for k in ("up", "down")}
            print(f"tune {fmt:>6} E{E} L{L} I{I} rows {xs.shape[0]:>6}: {ms:8.3f} ms  up {best.up}  down {best.down}")


HEADER = f"{'variant':>18} {'tokens':>6} {'rows':>6} {'hit':>4} {'ms':>9} {'TFLOP/s':>8} {'%peak':>6} {'GB/s':>7} {'%copy':>6}"


def row(name, E, L, I, ms, weight_bytes, flop, bw, flops, tokens=None, rows=None, hit=None) -> dict:
    """One table row: printed, and returned for the JSON report."""
    f, b = flop / (ms * 1e-3), weight_bytes / (ms * 1e-3)
    print(f"{name:>18} {tokens or '-':>6} {rows or '-':>6} {hit or E:>4} {ms:>9.3f} "
          + (f"{f / 1e12:>8.2f} {f / flops:>6.1%} " if flop else f"{'-':>8} {'-':>6} ") + f"{b / 1e9:>7.0f} {b / bw:>6.1%}")
    return dict(variant=name, experts=E, L=L, I=I, tokens=tokens, rows=rows, hit=hit, ms=ms, tflops=f / 1e12,
                peak=f / flops, gbs=b / 1e9, copy=b / bw)


def bench_layer(args, w, E: int, L: int, I: int, timed, bw: float, flops: float) -> list[dict]:
    """Every variant at every token count for one layer shape, then the layer's workspace conversion."""
    print(f"\nE {E}, top-{args.top_k}, L {L}, I {I}\n{HEADER}")
    out = []
    for tokens in args.tokens:
        xs, offsets, hit, routing = routed_rows(tokens, E, args.top_k, L, args.device, seed=tokens)
        ref_ok = tokens <= args.reference_max_tokens
        for name, (fmt, fn) in variants(w, xs, offsets, args.formats, ref_ok, routing).items():
            out.append(row(name, E, L, I, timed(fn), hit * 3 * L * I * BYTES_PER_WEIGHT[fmt], 2 * xs.shape[0] * L * I * 3,
                           bw, flops, tokens, xs.shape[0], hit))
    if "convert" in args.formats:
        try:
            moved = E * 3 * L * I * (BYTES_PER_WEIGHT["mxfp4"] + BYTES_PER_WEIGHT["fp8"])  # packed read, FP8 written
            out.append(row("convert", E, L, I, timed(convert_fn(w, args.device)), moved, 0, bw, flops))
        except torch.OutOfMemoryError:  # the conversion's fp32 / int64 temporaries of a whole layer
            out.append(dict(variant="convert", experts=E, L=L, I=I, error="out of memory"))
            print(f"{'convert':>18}  out of memory")
    return out


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--shapes", nargs="+", default=["4096:2048", "7168:2048"], help="hidden L : expert width I")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(14)])  # 1 .. 8192
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--reference-max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test under TRITON_INTERPRET=1)")
    ap.add_argument("--tune", action="store_true", help="tune the Triton block sizes and write the table")
    ap.add_argument("--tune-out", default=None, help="table to write (default: the one the kernels read)")
    ap.add_argument("--tune-formats", nargs="+", default=["bf16", "fp8", "mxfp4"],
                    choices=["bf16", "fp8", "mxfp4", "fp8_tile", "fp8_tile_a8"],
                    help="weight formats to tune (fp8: 32-blocks; fp8_tile: 128x128 tiles; _a8: FP8 activations)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.small:
        args.experts, args.shapes, args.top_k, args.repeats = [4], ["64:32"], 2, min(args.repeats, 2)
        args.tokens = [t for t in args.tokens if t <= 8] or [1]
    return args


def write_table(path: Path, device_name: str, table: dict) -> None:
    text = json.dumps({"device": device_name, "configs": table}, indent=1, sort_keys=True)
    text = re.sub(r"\[([\d,\s]+)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)  # a config per line
    path.write_text(text + "\n")
    print(f"wrote {path}")


def main(argv=None) -> dict:
    args = parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when triton is first imported, below
    from dayzero.ops.moe import triton_moe as T

    timed = timer(args.device, args.repeats)
    bw, flops = ceilings(args.device, args.small)
    fp8_flops = None if args.small else fp8_matmul_rate(args.device)
    device_name = T.device_name(torch.device(args.device))
    print(f"{device_name}: copy {bw / 1e9:.0f} GB/s, matmul {flops / 1e12:.1f} TFLOP/s "
          f"({'fp32' if args.device == 'cpu' else 'bf16'})"
          + (f", FP8 matmul {fp8_flops / 1e12:.1f} TFLOP/s (cuBLAS, %peak stays of bf16)" if fp8_flops else ""))
    path = Path(args.tune_out) if args.tune_out else T.CONFIGS
    table = json.loads(path.read_text()).get("configs", {}) if args.tune and path.exists() else {}
    rows = []
    for E in args.experts:
        for shape in args.shapes:
            L, I = map(int, shape.split(":"))
            w = layer(E, L, I, args.device)
            if args.tune:
                tune(args, w, E, L, I, timed, table)
            else:
                rows += bench_layer(args, w, E, L, I, timed, bw, flops)
            del w
            if args.device != "cpu":
                torch.cuda.empty_cache()
    report = {"args": vars(args), "device": device_name, "copy_bytes_s": bw, "matmul_flops": flops,
              "fp8_matmul_flops": fp8_flops, "rows": rows}
    if args.tune:
        write_table(path, device_name, table)
        report["configs"] = table
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
