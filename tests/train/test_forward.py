"""The training forward runs the engine's own layers: its logits equal the engine's prefill logits, gradients
reach every trainable parameter, and the training ops equal the references they stand in for."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM
from dayzero.engine.request import Sequence
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.scheduler import ScheduledSeq
from dayzero.ops.kda.reference import causal_conv1d, kda_chunk, kda_recurrent
from dayzero.ops.moe.reference import grouped_mlp, permute
from dayzero.train.batch import TrainBatch, take
from dayzero.train.checkpoint import load_model
from dayzero.train.forward import indexer_parameters, logits_of, losses, training
from dayzero.ops.kda.chunk_batched import kda_chunk_batched
from dayzero.train.linear_attention import causal_conv1d_train
from dayzero.train.routing import grouped_mlp_train

LENS = [5, 9, 12, 37]  # the tiny model's DSA top-k is 8: the last three attend sparsely


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in LENS]


@torch.inference_mode()
def _engine_prefill(path, prompts) -> torch.Tensor:
    eng = LLM(str(path), device="cpu", dtype="float32").engine
    seqs = [Sequence(f"s{i}", i, p, len(p), SamplingParams()) for i, p in enumerate(prompts)]
    for s in seqs:
        assert eng.cache.grow(s.seq_id, s.num_tokens)
    batch = eng.runner.build_batch([ScheduledSeq(s, s.num_tokens) for s in seqs], eng.cache)
    return eng.model.compute_logits(eng.model(batch))  # every row's logits


def test_training_logits_equal_engine_prefill(tiny_ckpt):
    prompts = _prompts()
    ref = _engine_prefill(tiny_ckpt, prompts)
    model = load_model(tiny_ckpt, "cpu")  # built by the project's builder, loaded by its loader
    batch = TrainBatch(torch.tensor(sum(prompts, [])), LENS, sparse=True)
    with training(model):
        got = logits_of(model, model(batch))
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # the layers' own caches are back once the block ends
    assert all(layer.cache is None for _, layer in model.cached_layers())


def _step_grads(model, prompts, sparse: bool):
    ids = torch.tensor(sum(prompts, []))
    batch = TrainBatch(ids, LENS, sparse=sparse)
    with training(model):
        out = losses(model, batch, torch.roll(ids, -1))
    out.indexer_kl.backward(inputs=indexer_parameters(model), retain_graph=True)
    (out.lm + 1e-2 * out.balance).backward()
    return out


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gradients_reach_every_trainable_parameter(tiny_ckpt, sparse):
    model = load_model(tiny_ckpt, "cpu")
    for m in model.modules():  # selection biases move by the loads (routing.update_bias), not by gradients
        if getattr(m, "e_score_correction_bias", None) is not None:
            m.e_score_correction_bias.requires_grad_(False)
    out = _step_grads(model, _prompts(1), sparse)
    assert out.indexer_kl.item() > 0
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    assert not bad, bad


def test_indexer_loss_reaches_only_the_indexer_and_main_loss_never_does(tiny_ckpt):
    model = load_model(tiny_ckpt, "cpu")
    ids = torch.tensor(sum(_prompts(2), []))
    batch = TrainBatch(ids, LENS, sparse=True)
    with training(model):
        out = losses(model, batch, torch.roll(ids, -1))
    indexer = set(map(id, indexer_parameters(model)))
    out.lm.backward(retain_graph=True)
    assert all(p.grad is None for p in model.parameters() if id(p) in indexer)
    model.zero_grad(set_to_none=True)
    out.indexer_kl.backward(inputs=indexer_parameters(model))
    assert all(p.grad is None for p in model.parameters() if id(p) not in indexer)


@pytest.mark.parametrize("T,H,K,C", [(1, 1, 4, 4), (7, 2, 4, 4), (13, 2, 8, 4)], ids=lambda v: str(v))
def test_kda_chunk_batched_equals_recurrent_and_passes_gradcheck(T, H, K, C):
    g = torch.Generator().manual_seed(T)
    q, k, v = (torch.randn(1, T, H, K, generator=g, dtype=torch.float64) for _ in range(3))
    q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    gate = -torch.rand(1, T, H, K, generator=g, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, T])
    ref, _ = kda_recurrent(q[0], k[0], v[0], gate[0], beta[0], 1.0, None, cu, use_qk_l2norm=False)
    got = kda_chunk_batched(q, k, v, gate, beta, C)[0][0]
    torch.testing.assert_close(got, ref.to(got.dtype), atol=1e-6, rtol=1e-6)
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, gate, beta))
    assert torch.autograd.gradcheck(lambda *a: kda_chunk_batched(*a, C)[0], inputs)


def test_kda_train_op_equals_reference_chunk_over_packed_sequences():
    from dayzero.train.linear_attention import kda_train

    lens = [3, 5, 70]
    g = torch.Generator().manual_seed(0)
    T, H, K = sum(lens), 2, 8
    q, k, v = (torch.randn(T, H, K, generator=g) for _ in range(3))
    gate, beta = -torch.rand(T, H, K, generator=g), torch.rand(T, H, generator=g)
    batch = TrainBatch(torch.zeros(T, dtype=torch.int64), lens)
    ref, _ = kda_chunk(q, k, v, gate, beta, K**-0.5, None, batch.cu_seqlens)
    torch.testing.assert_close(kda_train(q, k, v, gate, beta, K**-0.5, None, batch), ref, atol=2e-5, rtol=2e-5)


def test_conv_train_op_equals_reference_from_zero_windows():
    lens = [1, 2, 6]
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(sum(lens), 6, generator=g), torch.randn(6, 1, 4, generator=g)
    batch = TrainBatch(torch.zeros(sum(lens), dtype=torch.int64), lens)
    ref, _ = causal_conv1d(x, w, torch.zeros(len(lens), 6, 3), batch.cu_seqlens)
    torch.testing.assert_close(causal_conv1d_train(x, w, None, batch), ref)
    torch.testing.assert_close(causal_conv1d_train(x, w, None, batch, groups=3),
                               ref.view(-1, 3, 2).transpose(0, 1).contiguous())


@pytest.mark.parametrize("pad", [0, 3], ids=["routed", "padded"])
def test_grouped_experts_train_op_equals_reference(pad):
    g = torch.Generator().manual_seed(pad)
    E, L, I, T, k = 5, 16, 8, 13, 2
    w1, w2 = torch.randn(E, 2 * I, L, generator=g), torch.randn(E, L, I, generator=g)
    x = torch.randn(T, L, generator=g)
    order, offsets = permute(torch.randint(0, E, (T, k), generator=g), E)
    torch.testing.assert_close(grouped_mlp_train(x, offsets, w1, w2, order=order, top_k=k),
                               grouped_mlp(x, offsets, w1, w2, order=order, top_k=k))
    rows = torch.cat((x[order // k], torch.randn(pad, L, generator=g)))
    torch.testing.assert_close(grouped_mlp_train(rows, offsets, w1, w2), grouped_mlp(rows, offsets, w1, w2))


def test_use_platform_picks_its_implementations_and_falls_back_to_references():
    from dayzero import ops
    from dayzero.ops import registry

    calls = []
    registry.register("_train_toy")(lambda x: calls.append("ref") or x)
    registry.register("_train_toy", "train")(lambda x: calls.append("train") or x)
    registry.register("_train_toy_ref_only")(lambda x: calls.append("ref only") or x)
    with registry.use_platform("train"):
        assert registry.active_platform() == "train"
        ops.call("_train_toy", torch.zeros(1))
        ops.call("_train_toy_ref_only", torch.zeros(1))
    ops.call("_train_toy", torch.zeros(1))
    assert calls == ["train", "ref only", "ref"] and registry.active_platform() is None


@pytest.mark.parametrize("shape", [(7,), (3, 5)])
def test_take_gathers_and_accumulates_repeated_rows_like_indexing(shape):
    """The training's row gather (index_select, an index_add_ backward) against plain indexing, with rows repeated
    as padding cells repeat them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 3, generator=g, dtype=torch.float64)
    index = torch.randint(0, 6, shape, generator=g)
    index.view(-1)[: index.numel() // 2] = 2  # half the cells read one row
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    up = torch.randn(*shape, 4, 3, generator=g, dtype=torch.float64)
    (take(a, index) * up).sum().backward()
    (b[index] * up).sum().backward()
    assert torch.equal(take(x, index), x[index])
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)


def test_bias_update_moves_towards_balance_without_reading_back():
    from types import SimpleNamespace

    from dayzero.train.routing import Routed, update_bias

    layers = [SimpleNamespace(spec=SimpleNamespace(n_experts=4), e_score_correction_bias=torch.zeros(4))
              for _ in range(2)]
    ids = [torch.tensor([[0, 1], [0, 2], [0, 1]]), torch.tensor([[3, 2], [1, 0], [2, 3]])]  # loads 3,2,1,0 / 1,1,2,2
    worst = update_bias(layers, [Routed(torch.zeros(3, 4), i, "sigmoid") for i in ids], 0.1)
    assert isinstance(worst, torch.Tensor) and float(worst) == 2.0  # 3 / mean 1.5
    torch.testing.assert_close(layers[0].e_score_correction_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    torch.testing.assert_close(layers[1].e_score_correction_bias, torch.tensor([0.1, 0.1, -0.1, -0.1]))


def test_answer_rows_given_by_the_caller_give_the_same_losses(tiny_ckpt):
    from dayzero.train.forward import answer_rows

    model = load_model(tiny_ckpt, "cpu")
    ids = torch.tensor(sum(_prompts(3), []))
    targets = torch.roll(ids, -1).masked_fill(torch.arange(ids.numel()) % 3 == 0, -100)
    batch = TrainBatch(ids, LENS, sparse=True)
    with training(model):
        a = losses(model, batch, targets)
    batch = TrainBatch(ids, LENS, sparse=True)
    with training(model):
        b = losses(model, batch, targets, rows=answer_rows(targets))
    assert a.answer_tokens == b.answer_tokens == int((targets != -100).sum())
    torch.testing.assert_close(a.lm, b.lm)
