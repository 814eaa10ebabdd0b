"""fla-core's KDA kernels behind ``kda_pooled`` on CUDA (skipped without a GPU or without fla): the in-place fused
recurrent kernel on decode steps, and (unless ``DAYZERO_FLA_CHUNK=0``) the chunk kernel on prefill and mixed steps,
give the reference's outputs and pooled states on the same bf16 inputs, fresh sequences ignoring what their slot
held, every other slot untouched."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops.kda import cuda as kda_dev
from dayzero.ops.kda import reference as kda_ref
from tests.ops.paged_batch import make_batch
from tests.ops.test_batch_ops import delta_inputs
from tests.ops.varlen import RTOL, assert_close

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(kda_dev.chunk_kda is None, reason="fla-core is not installed")]

STEPS = {
    "decode-B1": ([9], [1]), "decode-B7": ([1, 0, 15, 8, 2, 0, 5], [1] * 7),
    "prefill": ([0, 0], [70, 5]), "mixed": ([0, 40, 7, 0, 130], [64, 1, 33, 1, 65]),
}


def to_cuda(batch):
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "state_slots", "logits_indices",
                 "cu_seqlens", "fresh"):
        setattr(batch, name, getattr(batch, name).cuda())
    return batch


@pytest.mark.parametrize("step", list(STEPS), ids=list(STEPS))
@pytest.mark.parametrize("H,K", [(2, 64), (4, 128)], ids=["H2-K64", "H4-K128"])
def test_fla_kernels_equal_the_reference(step, H, K):
    starts, news = STEPS[step]
    if set(news) != {1} and not kda_dev.fla_chunk_enabled(torch.bfloat16):
        pytest.skip("fla's chunk kernel is off (DAYZERO_FLA_CHUNK=0)")
    batch = to_cuda(make_batch(starts, news, 16, seed=H))
    g0 = torch.Generator().manual_seed(K)
    pool = torch.randn(17, H, K, K, generator=g0).cuda() * 0.1
    fresh_slots = batch.state_slots[batch.fresh]
    pool[fresh_slots] = float("nan")  # a fresh sequence must not read its slot's old state
    q, k, v, g, beta = (x.cuda() for x in delta_inputs(batch.num_tokens, H, K, K, 5))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()  # both sides see the same bf16 inputs
    ref_pool = pool.clone()
    ref = kda_ref.kda_pooled(q, k, v, g, beta, K**-0.5, ref_pool, batch).float()
    assert torch.isfinite(ref).all()
    out = kda_dev.kda_pooled_cuda(q, k, v, g, beta, K**-0.5, pool, batch)
    assert out.dtype == torch.bfloat16
    assert_close(out.float(), ref, RTOL[torch.bfloat16], "o")
    used = batch.state_slots
    assert_close(pool[used], ref_pool[used], RTOL[torch.bfloat16], "states")
    others = torch.ones(17, dtype=torch.bool, device="cuda")
    others[used] = False
    others[0] = False  # the null slot: written by rows that are not fresh, read by nothing
    assert torch.equal(pool[others].nan_to_num(7.0), ref_pool[others].nan_to_num(7.0))


@pytest.mark.parametrize("step", ["decode-B1", "decode-B7", "mixed"])
@pytest.mark.parametrize("lower", [None, -5.0], ids=["softplus", "lower-bound"])
def test_the_gate_applied_by_the_op_equals_the_reference(step, lower):
    """``gate=(A_log, dt_bias, lower_bound)``: g is the gate's input and beta its logits; decode steps activate
    both inside fla's kernel, other steps before it; both equal the reference's activation."""
    starts, news = STEPS[step]
    if set(news) != {1} and not kda_dev.fla_chunk_enabled(torch.bfloat16):
        pytest.skip("fla's chunk kernel is off (DAYZERO_FLA_CHUNK=0)")
    H, K = 4, 128
    batch = to_cuda(make_batch(starts, news, 16, seed=3))
    gen = torch.Generator().manual_seed(11)
    pool = (torch.randn(17, H, K, K, generator=gen) * 0.1).cuda()
    q, k, v, _, _ = (x.cuda() for x in delta_inputs(batch.num_tokens, H, K, K, 6))
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    f = torch.randn(batch.num_tokens, H, K, generator=gen).bfloat16().cuda()
    logits = torch.randn(batch.num_tokens, H + 3, generator=gen).bfloat16().cuda()[:, 1:H + 1]  # a strided slice
    gate = ((torch.randn(H, generator=gen) * 0.3).cuda(), (torch.randn(H * K, generator=gen) * 0.5).cuda(), lower)
    ref_pool = pool.clone()
    ref = kda_ref.kda_pooled(q, k, v, f, logits, K**-0.5, ref_pool, batch, gate=gate).float()
    out = kda_dev.kda_pooled_cuda(q, k, v, f, logits, K**-0.5, pool, batch, gate=gate)
    assert_close(out.float(), ref, RTOL[torch.bfloat16], "o")
    used = batch.state_slots
    assert_close(pool[used], ref_pool[used], RTOL[torch.bfloat16], "states")


@pytest.mark.parametrize("step", ["prefill", "mixed"])
def test_graph_mode_equals_host_lengths(step):
    """A step without host lengths (a captured one) runs fla's graph mode, its chunk list built on the device: the
    same outputs and states as the step with them."""
    from dayzero.engine.batch import StepPlan

    starts, news = STEPS[step]
    H, K = 4, 128
    outs = []
    for host in (True, False):
        batch = to_cuda(make_batch(starts, news, 16, seed=3))
        if not host:
            batch.plan = StepPlan(batch.plan.query_start, None, None, batch.plan.block_size)
        assert batch.host_lengths == host
        pool = torch.randn(17, H, K, K, generator=torch.Generator().manual_seed(1)).cuda() * 0.1
        q, k, v, g, beta = (x.cuda() for x in delta_inputs(batch.num_tokens, H, K, K, 5))
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        outs.append((kda_dev.kda_pooled_cuda(q, k, v, g, beta, K**-0.5, pool, batch), pool[batch.state_slots]))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
