"""LatentMoE equals its definition (ARCHITECTURE.md 3.3), written out per token in the test; hash routing
follows its table, which is checked once after loading."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dayzero.config.model_config import HybridConfig
from dayzero.config.spec import MoESpec
from dayzero.layers.moe import MoE
from dayzero.models.init import init_random_weights
from dayzero.ops.moe.reference import grouped_experts, route
from tests.conftest import tiny_config


def _per_token_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    cfg = moe.spec
    I = cfg.intermediate_size
    out = []
    for t in range(x.shape[0]):
        xt = x[t].double()
        s = torch.sigmoid(moe.gate.weight.double() @ xt)  # [E] unbiased scores
        sel = s + moe.e_score_correction_bias.double()
        groups = sel.view(cfg.n_group, -1)
        gscore = groups.topk(2, dim=-1).values.sum(-1)
        keep = gscore.topk(cfg.topk_group).indices
        masked = torch.full_like(groups, float("-inf"))
        masked[keep] = groups[keep]
        ids = masked.flatten().topk(cfg.top_k).indices
        w = s[ids] / s[ids].sum()
        z = moe.fc1_latent_proj.weight.double() @ xt  # [L]: routing read x, experts read z
        u = torch.zeros_like(z)
        for e, we in zip(ids.tolist(), w):
            gate, up = (moe.w1[e].double() @ z).split(I)
            u += we * (moe.w2[e].double() @ (torch.nn.functional.silu(gate) * up))
        if moe.latent_norm is not None:
            u = u * torch.rsqrt(u.pow(2).mean() + 1e-6) * moe.latent_norm.weight.double()
        y = cfg.routed_scaling_factor * (moe.fc2_latent_proj.weight.double() @ u)
        sh = moe.shared_experts
        gate, up = (sh.gate_up_proj.weight.double() @ xt).split(cfg.shared_intermediate_size)
        y = y + sh.down_proj.weight.double() @ (torch.nn.functional.silu(gate) * up)
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("latent_norm", [False, True], ids=["latent", "latent-norm"])
def test_latent_moe_equals_definition(latent_norm):
    m = HybridConfig.from_dict(tiny_config(moe_latent_norm=latent_norm)).to_spec()
    spec = m.layers[-1].mlp
    assert spec.latent_size not in (m.hidden_size, spec.intermediate_size)
    moe = init_random_weights(MoE(m.hidden_size, spec).float(), seed=3, std=0.2)
    x = torch.randn(11, m.hidden_size, generator=torch.Generator().manual_seed(0))
    got = moe(x)
    ref = _per_token_reference(moe, x).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-5, f"relative error {rel:.2e}"


def test_router_first_gives_the_same_output_and_is_refused_where_h_is_x():
    """A LatentMoE given its router's logits (computed ahead, with the input norm) equals one routing x itself; a
    MoE whose experts read x (no latent projection between the router and them), hash routing and training do
    not route first, and a layer that does not is refused the logits."""
    m = HybridConfig.from_dict(tiny_config()).to_spec()
    moe = init_random_weights(MoE(m.hidden_size, m.layers[-1].mlp).float(), seed=3, std=0.2)
    moe.process_weights_after_loading()
    x = torch.randn(5, m.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        router = moe.router_first()
        assert router is moe.gate
        logits = torch.nn.functional.linear(x, router.weight, router.bias)
        assert torch.equal(moe(x, logits=logits), moe(x))
        with pytest.raises(ValueError, match="routes first"):
            moe(x, projected=torch.zeros(5, sum(moe.fused_in.widths)), logits=logits)
    assert moe.router_first() is None  # grad enabled: training routes in its own ops
    plain = HybridConfig.from_dict(tiny_config(moe_latent_size=None)).to_spec()
    flat = init_random_weights(MoE(plain.hidden_size, plain.layers[-1].mlp).float(), seed=4)
    with torch.no_grad():
        assert flat.router_first() is None and _hash_moe().router_first() is None
        with pytest.raises(ValueError, match="routes first"):
            flat(x, logits=logits)


def test_plain_moe_without_latent_runs_at_full_width():
    m = HybridConfig.from_dict(tiny_config(moe_latent_size=None, router="softmax", n_group=1, topk_group=1)).to_spec()
    spec = m.layers[-1].mlp
    moe = init_random_weights(MoE(m.hidden_size, spec).float(), seed=4)
    assert moe.w1.shape == (spec.n_experts, 2 * spec.intermediate_size, m.hidden_size)
    assert moe.e_score_correction_bias is None and not hasattr(moe, "fc1_latent_proj")
    x = torch.randn(5, m.hidden_size)
    assert moe(x).shape == x.shape


def _hash_moe(vocab: int = 20) -> MoE:
    spec = MoESpec(n_experts=6, top_k=2, intermediate_size=8, router="sqrtsoftplus", hash_routing=True,
                   correction_bias=False)
    return init_random_weights(MoE(16, spec, vocab_size=vocab).float(), seed=5, std=0.3)


def test_hash_routing_follows_the_table():
    moe = _hash_moe()
    moe.process_weights_after_loading()  # the default table is valid
    with torch.no_grad():
        moe.tid2eid[3] = torch.tensor([5, 5])  # one expert in both slots of token 3
    tokens = torch.tensor([3, 0, 7, 19, 3])
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    got = moe(x, SimpleNamespace(input_ids=tokens))
    logits = x @ moe.gate.weight.t()
    weights, ids = route(logits, 2, "sqrtsoftplus", fixed_ids=moe.tid2eid[tokens])
    assert ids[0].tolist() == [5, 5]
    torch.testing.assert_close(got, grouped_experts(x, ids, weights, moe.w1, moe.w2))


@pytest.mark.parametrize("bad", [6, -1])
def test_process_weights_after_loading_rejects_bad_hash_table(bad):
    moe = _hash_moe()
    with torch.no_grad():
        moe.tid2eid[7, 1] = bad
    with pytest.raises(ValueError, match=rf"tid2eid holds expert ids in \[{min(bad, 0)}, {max(bad, 5)}\], outside \[0, 6\)"):
        moe.process_weights_after_loading()


def test_process_weights_after_loading_rejects_a_table_of_the_wrong_width():
    moe = _hash_moe()
    moe.tid2eid = torch.nn.Parameter(torch.zeros(20, 3, dtype=torch.long), requires_grad=False)
    with pytest.raises(ValueError, match="top_k=2"):
        moe.process_weights_after_loading()
