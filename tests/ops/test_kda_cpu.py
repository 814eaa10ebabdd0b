"""The CPU's kda_pooled (the batched chunk form over groups of similar length) against the reference: the same
outputs and the same states written to the same slots, on prefill and mixed steps of odd lengths, with fresh
and carried states, in one segment and in many."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops.kda import cpu as kda_cpu
from dayzero.ops.kda import reference as kda_ref
from dayzero.ops.registry import choose
from tests.ops.paged_batch import make_batch

STEPS = {  # (tokens cached before the step, tokens it brings) per sequence
    "prefill": ([0, 0, 0], [7, 33, 100]),
    "mixed": ([0, 5, 2, 0, 40], [9, 1, 4, 65, 1]),
    "one long": ([3], [257]),
}


def _inputs(T, H, K, V, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(T, H, K, generator=g), torch.randn(T, H, K, generator=g), torch.randn(T, H, V, generator=g)
    return q, k, v, -torch.rand(T, H, K, generator=g) * 0.7, torch.rand(T, H, generator=g)


@pytest.mark.parametrize("tokens", [4096, 64], ids=["one segment", "segments of 64 rows"])
@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
def test_cpu_kda_pooled_equals_the_reference(step, tokens, monkeypatch):
    monkeypatch.setattr(kda_cpu, "TOKENS", tokens)
    starts, news = STEPS[step]
    batch = make_batch(starts, news, 4, seed=3)
    H, K, V = 2, 16, 8
    pool = torch.randn(17, H, K, V, generator=torch.Generator().manual_seed(4))
    pool_cpu = pool.clone()
    xs = _inputs(batch.num_tokens, H, K, V, 5)
    ref = kda_ref.kda_pooled(*xs, 0.25, pool, batch)
    got = kda_cpu.kda_pooled_cpu(*xs, 0.25, pool_cpu, batch)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool_cpu, pool, atol=2e-5, rtol=2e-5)  # the batch's slots alike, the others untouched
    xs2 = _inputs(batch.num_tokens, H, K, V, 6)  # a second layer of the step: the grouping kept in the batch's memo
    torch.testing.assert_close(kda_cpu.kda_pooled_cpu(*xs2, 0.25, pool_cpu, batch),
                               kda_ref.kda_pooled(*xs2, 0.25, pool, batch), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(pool_cpu, pool, atol=2e-5, rtol=2e-5)


def test_cpu_kda_pooled_applies_the_gate_and_keeps_the_dtype():
    batch = make_batch([0, 6], [20, 3], 4, seed=6)
    H, K, V = 2, 8, 8
    q, k, v, f, b = _inputs(batch.num_tokens, H, K, V, 7)
    gate = (torch.randn(H), torch.randn(H * K), -5.0)
    pool = torch.randn(17, H, K, V)
    pool_cpu = pool.clone()
    args = (q.bfloat16(), k.bfloat16(), v.bfloat16(), f, b, 0.3)
    ref = kda_ref.kda_pooled(*args, pool, batch, gate=gate)
    got = kda_cpu.kda_pooled_cpu(*args, pool_cpu, batch, gate=gate)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(pool_cpu, pool, atol=1e-4, rtol=1e-4)


def test_groups_bound_padding_and_cover_every_sequence():
    lens = [1, 300, 2, 40, 41, 3, 1000, 60]
    out = kda_cpu.groups(lens)
    assert sorted(i for g in out for i in g) == list(range(len(lens)))
    assert all(max(lens[i] for i in g) <= 1.5 * min(lens[i] for i in g) for g in out)


def test_cpu_platform_chooses_it_for_prefill():
    batch = make_batch([0], [5], 4)
    xs = _inputs(5, 1, 4, 4, 8)
    platform, impl, _ = choose("kda_pooled", "cpu", *xs, 0.5, torch.zeros(17, 1, 4, 4), batch)
    assert platform == "cpu" and impl.fn is kda_cpu.kda_pooled_cpu
