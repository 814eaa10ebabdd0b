"""Compile the skinny decode kernel for an H100/H200 (sm90) without a GPU, with programmatic dependent launch and
the weight prefetch on, and check its PTX: the prefetches (one bulk prefetch instruction per weight) come before
the wait for the kernel before, and no load does. Run as ``python -m tests.ops.linear_triton_aot`` WITHOUT
``TRITON_INTERPRET``; prints one line per build, exits non-zero on an error.
"""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dayzero.ops.linear import kernels as K

POINTERS = ("x_ptr", "w_ptr", "b_ptr", "a_ptr", "y_ptr", "r_ptr", "g_ptr", "xn_ptr", "ro_ptr", "q_ptr", "x2_ptr",
            "w2_ptr")
FLOATS = ("eps", "limit", "alpha")
# (CUDA cores or tensor cores, second product, block): the engine's kinds of launch
BUILDS = (("cuda cores", False, (4, 2048, 4)), ("cuda cores", True, (8, 1024, 4)),
          ("tensor cores", False, (32, 128, 4, 4)), ("tensor cores", True, (16, 256, 4, 4)))


def compile_skinny(dot: bool, two: bool, block: tuple):
    bn, bk, warps = block[:3]
    constants = dict(HAS_BIAS=False, HAS_ADD=False, NORM=False, HAS_RES=False, ACT=0, CLAMP=False, HEAD=0, TWO=two,
                     SGATE=False, DOT=dot, DOT_F32=False, EVEN_K=True, BLOCK_M=16 if dot else 1, BLOCK_N=bn,
                     BLOCK_K=bk, PREFETCH=True, PIECES=max(1, 32 * warps // bn), PDL=True)
    signature = {n: "constexpr" if n in constants else "*bf16" if n in POINTERS else "fp32" if n in FLOATS else "i32"
                 for n in K._skinny_kernel.arg_names}
    options = dict(num_warps=warps, **({"num_stages": block[3]} if dot else {}))
    return triton.compile(ASTSource(K._skinny_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options)


def check(ptx: str, weights: int) -> str | None:
    """Why the PTX breaks the prefetch's order, or None."""
    lines = ptx.splitlines()
    at = lambda word: [i for i, line in enumerate(lines) if word in line]  # noqa: E731
    prefetches, waits, loads = at("cp.async.bulk.prefetch.L2.global"), at("griddepcontrol.wait"), at("ld.global")
    if len(prefetches) != weights:
        return f"{len(prefetches)} prefetch instructions, expected {weights}"
    if len(waits) != 1 or max(prefetches) > waits[0]:
        return "a prefetch after the wait, or no single wait"
    if loads and min(loads) < waits[0]:
        return "a load before the wait"
    return None


def main() -> int:
    failed = 0
    for kind, two, block in BUILDS:
        why = check(compile_skinny(kind == "tensor cores", two, block).asm["ptx"], 2 if two else 1)
        failed += why is not None
        print(f"{kind:>12} {'two products' if two else 'one product':>12} {block}: {why or 'prefetch, wait, loads'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
