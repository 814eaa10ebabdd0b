"""Compile the grouped-expert kernels for an H100/H200 (sm90) without a GPU: Triton's front end, its layout passes
and the bundled ptxas, with the argument specialisations a real launch gets (unit strides constexpr, 16-byte
aligned pointers). Run as ``python -m tests.ops.moe_triton_aot`` WITHOUT ``TRITON_INTERPRET`` (under the
interpreter the kernels are not compiled at all); prints one line per kernel and exits non-zero on an error.
"""
from __future__ import annotations

import sys

from dayzero.ops.moe import triton_moe_kernels as K
from tests.triton_compile import compile_sm90

WEIGHT = {0: "*bf16", 1: "*fp8e4nv", 2: "*fp8e4nv", 3: "*u8"}  # w_ptr per FMT
SCALE = {0: "*bf16", 1: "*fp32", 2: "*fp32", 3: "*u8"}  # ws_ptr per FMT
UNIT = ("s_xk", "s_wk", "s_sk", "s_bn")  # strides of 1 in real launches: constexpr there
RUNTIME = ("N", "m_tiles", "limit", "E")  # not known to be multiples of 16


def compile_kernel(kernel, types: dict, constants: dict, num_warps: int, num_stages: int):
    names = list(kernel.arg_names)
    constants = {**constants, **{n: 1 for n in UNIT if n in names}}
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n not in constants and n not in RUNTIME]
    return compile_sm90(kernel, signature, constants, aligned, dict(num_warps=num_warps, num_stages=num_stages))


def compile_pair(fmt: int, act: int, bm: int, bn: int, bk: int, warps: int, stages: int, act_fp8: bool = False,
                 L=2048, I=512):
    common = dict(L=L, I=I, FMT=fmt, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, E_POW2=64, DOT_F32=False,
                  PRECISION=None, ACT_FP8=act_fp8)
    ptrs = {"offs_ptr": "*i32", "w_ptr": WEIGHT[fmt], "ws_ptr": SCALE[fmt], "b_ptr": "*fp32"}
    gather = fmt in (0, 3)  # tokens read through the pair order (the engine's path), else rows already sorted
    act = "*fp8e4nv" if act_fp8 else "*bf16"  # FP8 activations: e4m3 codes and fp32 scales per 128 columns
    scales = "*fp32" if act_fp8 else "*bf16"
    up = compile_kernel(K.moe_up_kernel, {**ptrs, "x_ptr": act, "xs_ptr": scales, "ord_ptr": "*i64",
                                          "h_ptr": "*bf16", "limit": "fp32"},
                        {**common, "ACT": act, "GATED": act != K.RELU2.value, "HAS_BIAS": True, "HAS_LIMIT": act == 0,
                         "GATHER": gather, "TOP_K": 8}, warps, stages)
    down = compile_kernel(K.moe_down_kernel, {**ptrs, "h_ptr": act, "hs_ptr": scales, "y_ptr": "*bf16"},
                          {**common, "HAS_BIAS": True}, warps, stages)
    return up, down


CASES = [  # (FMT, ACT, BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, FP8 activations]): every format, every
    # activation, small and big tiles; TILE weights with FP8 activations
    (0, 0, 16, 64, 128, 4, 4), (1, 2, 16, 64, 128, 4, 4), (2, 1, 32, 64, 128, 4, 4), (3, 0, 16, 64, 128, 4, 4),
    (0, 0, 128, 64, 64, 8, 3), (3, 2, 64, 128, 64, 4, 3), (1, 0, 16, 64, 128, 4, 4, True), (1, 0, 128, 64, 128, 8, 3, True),
]


def fp8_dot(ttgir: str) -> bool:
    """Whether a dot of the compiled kernel takes e4m3 operands (FP8 tensor cores)."""
    return any("dot" in line and "f8E4M3FN" in line for line in ttgir.splitlines())


def compile_tile_conversion():
    """The MXFP4 -> FP8 tile workspace conversion kernel (``convert_kernels._fp8_tiles_kernel``)."""
    from dayzero.quant.convert_kernels import _fp8_tiles_kernel

    types = {"blocks_ptr": "*u8", "scales_ptr": "*u8", "out_ptr": "*fp8e4nv", "scale_out_ptr": "*fp32",
             "lut_ptr": "*fp32", "N": "i32", "G": "i32", "NT": "i32", "KT": "i32"}
    names = list(_fp8_tiles_kernel.arg_names)
    constants = {"ROUND_FIRST": False, "PDL": False}
    signature = {n: "constexpr" if n in constants else types[n] for n in names}
    aligned = [i for i, n in enumerate(names) if n.endswith("_ptr")]
    return compile_sm90(_fp8_tiles_kernel, signature, constants, aligned, dict(num_warps=8, num_stages=1))


def compile_activation_quantizer(K_: int = 2048):
    """The FP8 activation quantiser the grouped GEMMs read from (``quantize_groups_kernel``)."""
    return compile_kernel(K.quantize_groups_kernel, {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
                          {"K": K_, "BLOCK_R": 32, "ROUND_FIRST": False, "PDL": False}, 4, 1)


def main() -> int:
    k = compile_tile_conversion()
    print(f"tile conversion: shared {k.metadata.shared} B")
    k = compile_activation_quantizer()
    print(f"activation quantiser: shared {k.metadata.shared} B")
    for case in CASES:
        for name, k in zip(("up", "down"), compile_pair(*case)):
            ttgir = k.asm["ttgir"]
            pipelined = "async_copy_global_to_local" in ttgir
            fp8 = fp8_dot(ttgir)
            print(f"{name:>4} {case}: shared {k.metadata.shared} B, pipelined {pipelined}, FP8 dot {fp8}")
            if not pipelined:
                print("  the K loop's loads were not pipelined", file=sys.stderr)
                return 1
            if fp8 != (len(case) > 7 and case[7]):
                print("  FP8 activations and an FP8 dot go together", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
