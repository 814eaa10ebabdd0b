"""Greedy sampling in one Triton launch: a program per row streams the logits once, keeping per lane the running
maximum, its first index and the sum of exponentials below it (an online softmax), and whether anything was not
finite; the lanes then give the row's first maximum and its log-probability, ``-log Σ exp(x - max)``.

The sampler takes this path when every row of a step is greedy, none is penalised and none asks for
alternatives: one launch instead of the ~20 small torch kernels (and their host launches) of the general path.
"""
from __future__ import annotations

import torch

from dayzero.ops.registry import register
from dayzero.ops.triton_support import HAS_TRITON, pdl, triton_refusal

if HAS_TRITON:
    import triton
    import triton.language as tl

    from dayzero.ops.triton_support import grid_dependency

BLOCK = 1024  # logits a program holds per step of its row

if HAS_TRITON:
    @triton.jit
    def _greedy_kernel(x_ptr, ids_ptr, lp_ptr, V, s_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
        # x: [B, V] (unit column stride); ids: [B] int64; lp: [B] fp32; grid: B
        grid_dependency(PDL)
        row = tl.program_id(0).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)  # each lane's running max, its first index, sum below it
        arg = tl.zeros((BLOCK,), tl.int32)
        s = tl.zeros((BLOCK,), tl.float32)
        bad = tl.zeros((BLOCK,), tl.int32)
        for v0 in range(0, V, BLOCK):
            cols = v0 + lanes
            ok = cols < V
            x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=float("-inf")).to(tl.float32)
            bad |= (ok & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32)
            new = tl.maximum(m, x)
            arg = tl.where(x > m, cols, arg)  # strictly greater: a lane keeps its first maximum
            base = tl.where(new > float("-inf"), new, 0.0)  # lanes still without a value keep s = 0, no inf - inf
            s = s * tl.exp(m - base) + tl.exp(x - base)
            m = new
        top = tl.max(m, 0)
        idx = tl.min(tl.where(m == top, arg, V), 0)  # the first of the lanes' first maxima
        total = tl.sum(s * tl.exp(m - top), 0)
        failed = tl.max(bad, 0) > 0
        tl.store(ids_ptr + row, tl.where(failed, -1, idx).to(tl.int64))
        tl.store(lp_ptr + row, tl.where(failed, float("nan"), -tl.log(total)))


def greedy_sample_triton(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, V = logits.shape
    ids = torch.empty(B, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(B, dtype=torch.float32, device=logits.device)
    if B:
        _greedy_kernel[(B,)](logits, ids, logprobs, V, logits.stride(0), BLOCK=BLOCK, num_warps=4, **pdl(logits))
    return ids, logprobs


def refusal(logits: torch.Tensor) -> str | None:
    why = triton_refusal(logits)
    if why is not None:
        return why
    if logits.dim() != 2 or logits.stride(-1) != 1:
        return "logits must be [B, V] with contiguous rows"
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"{logits.dtype} logits"
    if logits.shape[1] >= 2**31:
        return "vocabularies past 2**31 ids"
    return None


@register("greedy_sample", "cuda", verifier=refusal, note="Triton, one pass per row")
def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return greedy_sample_triton(logits)
