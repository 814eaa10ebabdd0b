"""The one-launch Triton ``moe_permute`` against the reference's stable sort: the same order (ties in token order)
and the same row ends, for skewed and uniform routings, empty experts, one pair, odd pair counts around the
tile sizes, int32 and int64 ids; on the CPU through Triton's interpreter, on a GPU at real sizes and inside a
CUDA graph."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.moe import permute_kernels as P
from dayzero.ops.moe.reference import permute as reference_permute

pytestmark = pytest.mark.skipif(not P.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def routing(T: int, k: int, E: int, seed: int, skew: bool = False, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if skew:  # most pairs on a few experts, many experts empty: long runs of ties
        ids = torch.randint(0, 3, (T, k), generator=g) * (E // 3)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    return ids.to(dtype).to(DEV)


def check(ids, E):
    assert P.refusal(ids, E) is None
    order, offsets = P.permute(ids, E)
    want_order, want_offsets = reference_permute(ids, E)
    assert order.dtype == torch.int64 and offsets.dtype == torch.int32
    assert torch.equal(order, want_order)
    assert torch.equal(offsets, want_offsets)
    # the load counters: raised by the row ends in the same launch, as the reference raises them
    start = torch.arange(E, dtype=torch.int64, device=ids.device) * 3
    load, want_load = start.clone(), start.clone()
    assert P.refusal(ids, E, load) is None
    P.permute(ids, E, load=load)
    reference_permute(ids, E, load=want_load)
    assert torch.equal(load, want_load) and torch.equal(load - start, want_offsets.long())


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (1, 2, 4), (3, 2, 5), (33, 2, 8), (64, 8, 64), (65, 3, 130)])
@pytest.mark.parametrize("skew", [False, True], ids=["uniform", "skewed"])
def test_equals_the_reference_sort(T, k, E, skew):
    check(routing(T, k, E, seed=T * 7 + k, skew=skew and E >= 3), E)


def test_int32_ids_and_a_non_contiguous_view():
    ids = routing(20, 4, 16, seed=3, dtype=torch.int32)
    check(ids, 16)
    wide = routing(20, 8, 16, seed=4)
    check(wide[:, ::2], 16)


def test_no_tokens():
    order, offsets = P.permute(torch.zeros(0, 8, dtype=torch.int64, device=DEV), 6)
    assert order.numel() == 0 and torch.equal(offsets, torch.zeros(6, dtype=torch.int32, device=DEV))


def test_refusals_name_the_reason():
    assert "faster" in P.refusal(torch.zeros(P.MAX_PAIRS + 1, 1, dtype=torch.int64, device=DEV), 4)
    assert P.refusal(torch.zeros(4, dtype=torch.int64, device=DEV), 4) is not None  # not [T, k]
    assert P.refusal(torch.zeros(4, 2, device=DEV), 4) is not None  # float ids


@gpu
@pytest.mark.parametrize("T", [1, 64, 2048])
def test_gpu_real_sizes(T):
    check(routing(T, 8, 256, seed=T), 256)
    check(routing(T, 8, 256, seed=T + 1, skew=True), 256)


@gpu
def test_gpu_graph_replay_with_other_routings():
    ids = routing(32, 8, 64, seed=0)
    P.permute(ids, 64)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        order, offsets = P.permute(ids, 64)
    for seed in (1, 2):
        ids.copy_(routing(32, 8, 64, seed=seed, skew=seed == 2))
        graph.replay()
        want_order, want_offsets = reference_permute(ids, 64)
        assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
