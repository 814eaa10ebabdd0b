"""The CPU's ``kda_pooled`` for prefill and mixed steps: every sequence of the step in the batched chunk form
(:func:`~dayzero.ops.kda.chunk_batched.kda_chunk_batched`), sequences of similar length together, from their
slots' states, the final states written back in place.

The reference (:func:`dayzero.ops.kda.reference.kda_pooled`) runs the chunk form one sequence at a time and
solves each chunk's triangular system row by row: about ``rows`` small calls a layer, which on a CPU cost more
than the arithmetic. Here a group of sequences is padded to its longest (at most 1.5× the shortest: as little
padding as training's length buckets) and cut into segments of at most ``TOKENS`` padded rows, each one batched
call that carries the states to the next. Decode steps (one row a sequence) keep the reference's recurrent
form, which already runs every sequence at once.
"""
from __future__ import annotations

import torch

from dayzero.ops.kda.chunk_batched import kda_chunk_batched, length_runs
from dayzero.ops.kda.reference import _prep, kda_gate, pooled_state
from dayzero.ops.kda.reference import kda_pooled as kda_pooled_reference
from dayzero.ops.registry import register

CHUNK = 8  # rows of a chunk: its decays are [rows, CHUNK, K] per head (8: the fastest of 4-32 on a 2-core CPU)
TOKENS = 8192  # padded rows of one batched call: its scratch is TOKENS × CHUNK × K × H fp32 (64 MiB at K 64, H 4)
GROWTH = 1.5  # a group's longest sequence over its shortest


def groups(lens: list[int], growth: float = GROWTH) -> list[list[int]]:
    """Indices of the sequences grouped by length (each group's longest at most ``growth`` × its shortest),
    shortest first."""
    order = sorted(range(len(lens)), key=lambda i: lens[i])
    return [[order[j] for j in run] for run in length_runs([lens[i] for i in order], growth)]


def _rows(starts: list[int], lens: list[int], a: int, width: int, pad_row: int) -> torch.Tensor:
    """[B, width] row indices of positions a .. a+width of each sequence, ``pad_row`` past its end."""
    j = a + torch.arange(width)
    rows = torch.tensor(starts)[:, None] + j
    return torch.where(j < torch.tensor(lens)[:, None], rows, pad_row)


def _plan(batch, T: int, device) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Per group of sequences: their indices and each segment's [B, w] rows (the spare row T past a sequence's
    end). The same for every KDA layer of the step: made once, kept in the batch's memo."""
    memo = getattr(batch, "memo", None)
    if memo is not None and ("kda_cpu_plan", T) in memo:
        return memo[("kda_cpu_plan", T)]
    query_start = batch.plan.query_start
    lens = [e - s for s, e in zip(query_start[:-1], query_start[1:])]
    plan = []
    for group in groups(lens):
        starts, glens = [query_start[i] for i in group], [lens[i] for i in group]
        width = max(glens)
        seg = max(CHUNK, TOKENS // len(group) // CHUNK * CHUNK)  # rows of a sequence per call
        segments = [_rows(starts, glens, a, min(seg, width - a), T).to(device) for a in range(0, width, seg)]
        plan.append((torch.tensor(group, device=device), segments))
    if memo is not None:
        memo[("kda_cpu_plan", T)] = plan
    return plan


@register("kda_pooled", "cpu", note="the batched chunk form over groups of similar length; decode as the reference")
def kda_pooled_cpu(q, k, v, g, beta, scale: float, state_pool: torch.Tensor, batch, use_qk_l2norm: bool = True,
                   gate: tuple | None = None, zeroed: bool = False):
    # q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; state_pool: [slots + 1, H, K, V] fp32 -> o [T, H, V]
    if batch.is_decode:
        return kda_pooled_reference(q, k, v, g, beta, scale, state_pool, batch, use_qk_l2norm, gate, zeroed)
    if gate is not None:
        g, beta = kda_gate(g, *gate), torch.sigmoid(beta.float())
    T, H, _ = q.shape
    V = v.shape[-1]
    # one zero row after the step's rows: padding reads it (k = beta = 0, g = 0 change no state)
    xs = [torch.cat((x, x.new_zeros(1, *x.shape[1:]))) for x in _prep(q, k, v, g, beta, scale, use_qk_l2norm)]
    state = pooled_state(state_pool, batch)  # [N, H, K, V] fp32
    o = torch.zeros(T + 1, H, V, dtype=torch.float32, device=q.device)
    for idx, segments in _plan(batch, T, q.device):
        S = state[idx]
        for rows in segments:
            out, S = kda_chunk_batched(*(x[rows] for x in xs), C=CHUNK, initial_state=S)
            o[rows] = out  # padding lands on the spare row T
        state[idx] = S
    state_pool[batch.state_slots] = state
    return o[:T].to(v.dtype)
