"""The indexer's top-k of long rows in two stages (segments' top-k, then the candidates'): the same keys as one
torch.topk over the row, sorted by score, for rows with and without a tail past the last whole segment, causal
masks that leave fewer finite scores than k, and the scratch the varlen form counts for it."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.indexer import triton_indexer as ti


@pytest.mark.parametrize("T,W,k", [(3, 4 * 16384, 2048), (2, 5 * 16384 + 777, 2048), (4, 70000, 64), (2, 40000, 2048)],
                         ids=lambda v: str(v))
def test_two_stages_select_the_same_keys(T, W, k):
    g = torch.Generator().manual_seed(W)
    scores = torch.randn(T, W, generator=g)
    positions = torch.randint(0, W, (T,), generator=g)
    positions[0] = k // 2  # fewer causal keys than k: -inf fill the rest
    scores.masked_fill_(torch.arange(W)[None, :] > positions[:, None], float("-inf"))
    n, _ = ti.topk_segments(W, k)
    assert (n > 1) == (W >= 4 * max(ti.TOPK_SEGMENT, 4 * k))
    got = ti.topk_indices(scores, k)
    want = torch.topk(scores, k, dim=-1, sorted=True)
    assert torch.equal(scores.gather(1, got), want.values)  # sorted the same: the k largest, largest first
    out = ti.topk_of_scores(scores, positions, k, torch.empty(T, k + 3, dtype=torch.int64))
    for t in range(T):
        valid = min(k, int(positions[t]) + 1)
        assert sorted(out[t, :valid].tolist()) == sorted(want.indices[t, :valid].tolist())
        assert (out[t, valid:] == -1).all()


def test_the_varlen_scratch_counts_the_candidates():
    W, k = 1 << 20, 2048
    n, _ = ti.topk_segments(W, k)
    assert n == W // ti.TOPK_SEGMENT
    assert ti.topk_bytes(W, k) == k * 12 * (n + 2)
    rows = ti.chunk_rows(W, k)
    assert rows * (W * 4 + ti.topk_bytes(W, k)) <= ti.SCRATCH_BUDGET
    assert ti.scratch_bytes(10 * rows, W, k) <= ti.SCRATCH_BUDGET
    assert ti.topk_bytes(8192, k) == k * 12  # short rows: one stage
