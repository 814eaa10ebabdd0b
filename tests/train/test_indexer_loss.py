"""The DSA indexer's KL loss: zero (with zero, finite gradients) when the indexer already matches the main
attention, never NaN over masked keys, and falling when the indexer trains on it alone."""
from __future__ import annotations

import torch

from dayzero.train.attention import indexer_kl, indexer_scores
from dayzero.train.batch import TrainBatch
from dayzero.train.checkpoint import load_model
from dayzero.train.forward import indexer_parameters, losses, training


def _bucket(L: int):
    batch = TrainBatch(torch.zeros(2 * L, dtype=torch.int64), [L, L])
    return batch.buckets[0]


def test_kl_is_zero_with_zero_gradients_when_indexer_matches_attention():
    # one indexer head, weight 1, keys = the main keys: ReLU(q·k) = q·k when every dot is positive; the main
    # attention of one head softmaxes scale·q·k, so with scale 1 the two distributions agree exactly
    L, D, topk = 12, 4, 3
    g = torch.Generator().manual_seed(0)
    k = torch.rand(2, L, 1, D, generator=g) + 0.1
    q = torch.rand(2, L, 1, D, generator=g) + 0.1
    iq = q.reshape(2 * L, 1, D).clone().requires_grad_()
    ik = k.reshape(2 * L, D).clone().requires_grad_()
    iw = torch.ones(2 * L, 1, requires_grad=True)
    kl = indexer_kl(q, k, None, 1.0, _bucket(L), iq, iw, ik, topk, max_rows=64)
    assert abs(kl.item()) < 1e-6
    kl.backward()
    for t in (iq, ik, iw):
        assert torch.isfinite(t.grad).all() and t.grad.abs().max() < 1e-5


def test_kl_over_a_sparse_selection_has_no_nan():
    L, D, topk = 16, 4, 4
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, L, 2, D, generator=g), torch.randn(2, L, 2, D, generator=g)
    iq = torch.randn(2 * L, 3, D, generator=g, requires_grad=True)
    ik = torch.randn(2 * L, D, generator=g, requires_grad=True)
    iw = torch.randn(2 * L, 3, generator=g, requires_grad=True)
    with torch.no_grad():  # the indexer's own top-k as the selection (what a sparse step attends over)
        s = indexer_scores(iq.view(2, L, 3, D), iw.view(2, L, 3), ik.view(2, L, D))
        s = s.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        sel = s.topk(topk, -1).indices
    mask = torch.zeros(2, L, L, dtype=torch.bool).scatter_(-1, sel, True) & torch.ones(L, L, dtype=torch.bool).tril()
    kl = indexer_kl(q, k, mask, D**-0.5, _bucket(L), iq, iw, ik, topk, max_rows=64)
    assert torch.isfinite(kl) and kl.item() >= 0
    kl.backward()
    assert all(torch.isfinite(t.grad).all() for t in (iq, ik, iw))


def test_kl_decreases_when_the_indexer_trains_on_it(tiny_ckpt):
    model = load_model(tiny_ckpt, "cpu")
    params = indexer_parameters(model)
    opt = torch.optim.Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(3)
    lens = [40, 48]
    ids = torch.randint(0, 256, (sum(lens),), generator=g)
    kls = []
    for _ in range(8):
        batch = TrainBatch(ids, lens, sparse=False)
        with training(model):
            out = losses(model, batch, torch.roll(ids, -1))
        opt.zero_grad()
        out.indexer_kl.backward(inputs=params)
        opt.step()
        kls.append(out.indexer_kl.item())
    assert kls[-1] < 0.8 * kls[0], kls
