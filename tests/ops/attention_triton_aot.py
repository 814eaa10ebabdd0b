"""Compile the attention kernels over the paged pools (the DSA indexer's scores, decode and varlen; the absorbed
MLA split kernel; paged GQA) for an H100/H200 (sm90) without a GPU, over plain bf16 pools and quantised ones
(fp8 / int8 codes with their scales), at the target model's shapes: Triton's front end, layout passes and the
bundled ptxas. Run as ``python -m tests.ops.attention_triton_aot`` WITHOUT ``TRITON_INTERPRET``; prints one line
per kernel, exits non-zero on an error.
"""
from __future__ import annotations

import sys

import triton.language as tl

from dayzero.ops.attention import triton_mla as M
from dayzero.ops.attention import triton_paged as G
from dayzero.ops.indexer import triton_indexer as X
from tests.triton_compile import compile_sm90

POOLS = {"bf16": ("*bf16", "*bf16", False), "fp8": ("*fp8e4nv", "*bf16", True), "int8": ("*i8", "*bf16", True)}
RUNTIME = ("key_width", "T", "H", "num_keys", "keys_per_split", "B", "G", "window")  # not multiples of 16
FLOATS = ("qk_scale",)


def compile_kernel(kernel, types: dict, constants: dict, num_warps: int, num_stages: int = 3):
    names = list(kernel.arg_names)
    signature = {n: "constexpr" if n in constants else types.get(n, "fp32" if n in FLOATS else
                                                                       "i32" if n.startswith(("s_",) + RUNTIME) else "*i32")
                 for n in names}
    aligned = [i for i, n in enumerate(names) if n not in constants and n not in RUNTIME and n not in FLOATS]
    return compile_sm90(kernel, signature, constants, aligned, dict(num_warps=num_warps, num_stages=num_stages))


def kernels(pool: str):
    rows, scales, quant = POOLS[pool]
    common = dict(DOT_F32=False, PRECISION="tf32", PDL=False, QUANT=quant, DT=tl.bfloat16)
    ptrs = {"q_ptr": "*bf16", "w_ptr": "*fp32", "k_ptr": rows, "ks_ptr": scales, "out_ptr": "*fp32"}
    yield "indexer decode", compile_kernel(X._decode_scores_kernel, ptrs, dict(
        HI=64, DI=128, PAGE=64, BLOCK_H=64, BLOCK_D=128, BLOCK_N=128, **common), 8)
    yield "indexer varlen", compile_kernel(X._varlen_scores_kernel, ptrs, dict(
        HI=64, DI=128, PAGE=64, BLOCK_M=64, BLOCK_D=128, BLOCK_N=64, **common), 8)
    ptrs = {"q_ptr": "*bf16", "qp_ptr": "*bf16", "lat_ptr": rows, "ls_ptr": scales, "sel_ptr": "*i64", "o_ptr": "*fp32",
            "ml_ptr": "*fp32", "sink_ptr": "*fp32"}
    yield "mla split", compile_kernel(M._split_kernel, ptrs, dict(
        R=512, P=64, PAGE=64, SPARSE=True, HAS_SEQ=False, FINAL=False, HAS_SINK=True, BLOCK_H=M.BLOCK_H,
        BLOCK_R=512, BLOCK_P=64, BLOCK_N=M.BLOCK_N, EARLY=True, **common), M.NUM_WARPS, 2)
    ptrs = {"q_ptr": "*bf16", "k_ptr": rows, "v_ptr": rows, "ks_ptr": scales, "vs_ptr": scales, "o_ptr": "*bf16",
            "sink_ptr": "*fp32"}
    yield "paged gqa", compile_kernel(G._paged_attention_kernel, ptrs, dict(
        DQK=128, DV=128, PAGE=16, HAS_WINDOW=True, HAS_SINK=True, BLOCK_M=32, BLOCK_G=4, BLOCK_N=64, BLOCK_D=128,
        BLOCK_DV=128, **common), 8, 2)


def main() -> int:
    for pool in POOLS:
        for name, k in kernels(pool):
            print(f"{name:>15} ({pool} pool): shared {k.metadata.shared} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
