"""Linears of one input fused into one GEMM (dayzero.layers.fused): the same outputs as the separate linears,
the same parameter names, loads after fusing reach the fused weight, and groups that cannot fuse stay apart."""
from __future__ import annotations

import torch
from torch import nn

from dayzero.layers.fused import FusedLinear, fuse, project
from dayzero.layers.fp8_linear import BlockFp8Linear


class Owner(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.a = nn.Linear(16, 5, bias=bias)
        self.inner = nn.Module()
        self.inner.b = nn.Linear(16, 7, bias=bias)
        self.c = nn.Linear(16, 3, bias=bias)


MEMBERS = ["a", "inner.b", "c"]


def separate(m, x):
    return [m.a(x), m.inner.b(x), m.c(x)]


def test_fused_outputs_equal_the_separate_linears_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (False, True):
        m = Owner(bias)
        x = torch.randn(4, 16)
        want = separate(m, x)
        keys = list(m.state_dict())
        assert fuse(m, "fused", MEMBERS)
        assert isinstance(m.fused, FusedLinear) and m.fused.out_features == 15
        got = project(m, "fused", MEMBERS, x)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert list(m.state_dict()) == keys  # no new names, nothing duplicated


def test_a_load_after_fusing_reaches_the_fused_weight():
    torch.manual_seed(1)
    m, other = Owner(), Owner()
    fuse(m, "fused", MEMBERS)
    m.load_state_dict(other.state_dict())
    x = torch.randn(3, 16)
    for g, w in zip(project(m, "fused", MEMBERS, x), separate(other, x)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    # fusing again (weights prepared twice) keeps the outputs
    assert fuse(m, "fused", MEMBERS)
    for g, w in zip(project(m, "fused", MEMBERS, x), separate(other, x)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_groups_that_cannot_fuse_keep_their_linears():
    m = Owner()
    m.c = BlockFp8Linear(16, 3)  # a quantised member
    assert not fuse(m, "fused", MEMBERS) and "fused" not in m._modules
    mixed = Owner()
    mixed.c = nn.Linear(16, 3, bias=True)  # biases on some members only
    assert not fuse(mixed, "fused", MEMBERS)
    x = torch.randn(2, 16)
    for g, w in zip(project(mixed, "fused", MEMBERS, x), separate(mixed, x)):
        torch.testing.assert_close(g, w)


def test_the_engine_fuses_each_mixer_and_latent_moe(tiny_ckpt):
    from dayzero import LLM

    llm = LLM(str(tiny_ckpt), device="cpu", dtype="float32", block_size=4, num_cache_blocks=64)
    kinds = {tuple(m.members) for m in llm.engine.model.modules() if isinstance(m, FusedLinear)}
    assert ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj") in kinds  # KDA
    kda = next(m for _, m in llm.engine.model.cached_layers() if hasattr(m, "gate_ups"))
    # the two gate up-projections: views of one [2, P, K], applied as one batched GEMM
    assert kda._gate_up_weight.shape == (2, kda.P, kda.K)
    assert kda.f_b_proj.weight.data_ptr() == kda._gate_up_weight.data_ptr()
    fa, ga = torch.randn(3, kda.K), torch.randn(3, kda.K)
    got = kda.gate_ups(fa, ga, torch.cat((fa, ga), dim=-1))
    for g, w in zip(got, (kda.f_b_proj(fa), kda.g_b_proj(ga))):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wk", "g_proj") in kinds  # gated DSA
    assert ("q_proj", "k_proj", "v_proj") in kinds  # GQA
    assert ("fc1_latent_proj", "shared_experts.gate_up_proj") in kinds  # LatentMoE with a shared expert
