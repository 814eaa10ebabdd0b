"""Training data: the train split's retrieval instances come in small sizes too (short copies, recall prompts
with few pairs), while the eval split keeps the sizes ``dayzero eval`` scores; a step packs in length order with
the loss on answer tokens only; bad data settings are refused."""
from __future__ import annotations

import re

import pytest
import torch

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.tokenizer import load_tokenizer
from dayzero.eval.tasks import Instance, as_question, instances
from dayzero.train.data import IGNORE, DataConfig, TaskStream, pack


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


def facts(prompt: str) -> int:
    return len(re.findall(r"(?<![A-Za-z])(?:[A-Z]|[a-z]{4})=\d{4}\.", prompt))  # one-letter or four-letter keys


def test_train_split_has_short_copies_and_few_pair_recalls_the_eval_split_full_ones():
    c = DataConfig()
    train_copies = instances("copy", 200, "train", seed=1, **c.options("copy"))
    sizes = {len(i.answer.split()) for i in train_copies}
    assert min(sizes) == c.copy_min_words and max(sizes) == c.copy_words and len(sizes) > 10
    assert {len(i.answer.split()) for i in instances("copy", 50, "eval", seed=1)} == {32}
    train_recalls = instances("recall", 60, "train", seed=1, context_len=400, **c.options("recall"))
    pairs = {facts(i.prompt) for i in train_recalls}
    assert min(pairs) == c.recall_min_pairs and max(pairs) == 8
    assert {facts(i.prompt) for i in instances("recall", 20, "eval", seed=1, context_len=400)} == {8}


def test_a_step_packs_by_length_with_loss_on_answers_only(tokenizer):
    stream = TaskStream(DataConfig(tokens=8192), tokenizer, seed=0)
    step = stream.step(0, 0.0)
    assert step.lens == sorted(step.lens) and sum(step.lens) == step.ids.numel() == step.targets.numel()
    answer = step.targets != IGNORE
    assert 0 < answer.sum() < step.ids.numel() // 2
    assert set(step.tasks) == {"recall", "addition", "subtraction", "reversal", "sorting", "copy"}


def test_copies_dominate_the_first_part_of_training_then_the_configured_shares(tokenizer):
    c = DataConfig(tokens=16384)
    total = sum(c.weights.values())
    late = c.weights_at(c.copy_warmup)
    assert late == pytest.approx({t: w / total for t, w in c.weights.items()})
    early = c.weights_at(0.0)
    assert sum(early.values()) == pytest.approx(1.0) and early["copy"] == pytest.approx(c.copy_warmup_share)
    others = [t for t in c.weights if t != "copy"]  # the other tasks keep their proportions to each other
    assert [early[t] / early["addition"] for t in others] == pytest.approx([late[t] / late["addition"] for t in others])
    assert DataConfig(copy_warmup=0.0).weights_at(0.0) == pytest.approx(late)
    assert DataConfig(weights={"copy": 1.0}).weights_at(0.0) == {"copy": 1.0}
    assert DataConfig(weights={"addition": 1.0}).weights_at(0.0) == {"addition": 1.0}
    stream = TaskStream(c, tokenizer, seed=0)
    copied = [stream.step(0, p).tasks["copy"] for p in (0.0, 0.5)]  # copies in a step
    assert copied[0] > 3 * copied[1]


@pytest.mark.parametrize("bad", [dict(recall_min_pairs=0), dict(recall_min_pairs=9), dict(copy_min_words=0),
                                 dict(weights={"recall": 1.0}), dict(tokens=8), dict(copy_warmup=1.5),
                                 dict(copy_warmup_share=1.0), dict(recall_style="verse"),
                                 dict(recall_questions=0), dict(question_share=1.5), dict(chat_share=-0.1)])
def test_bad_data_settings_are_refused(bad):
    with pytest.raises(ValueError):
        DataConfig(**bad)


def test_each_task_gets_an_equal_part_of_the_loss(tokenizer):
    step = TaskStream(DataConfig(tokens=8192), tokenizer, seed=0).step(0, 0.0)
    w, answer = step.loss_weights, step.targets != IGNORE
    assert w.shape == step.targets.shape and w.sum().item() == pytest.approx(1.0, rel=1e-5)
    assert (w[~answer] == 0).all() and (w[answer] > 0).all()
    # each task's answer tokens share one weight, and together weigh 1/6: recall's few tokens weigh the most
    parts = sorted((v.item() * (w == v).sum().item()) for v in w[answer].unique())
    assert len(parts) == len(step.tasks) == 6 and parts == pytest.approx([1 / 6] * 6, rel=1e-4)
    assert w[answer].max() / w[answer].min() > 10
    token = TaskStream(DataConfig(tokens=8192, loss_balance="token"), tokenizer, seed=0).step(0, 0.0)
    n = answer.sum().item()
    assert torch.equal(token.targets, step.targets)
    assert torch.allclose(token.loss_weights[answer], torch.full((n,), 1 / n))


def test_pack_weights_groups_equally():
    seqs = [([1, 2, 3, 4], 2), ([5, 6, 7], 1), ([8, 9, 10, 11, 12], 4)]  # 2, 2 and 1 answer tokens
    ids, targets, lens, w = pack(seqs, ["a", "a", "b"])
    assert lens == [3, 4, 5] and ids.tolist() == [5, 6, 7, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    # group a: 4 answer tokens sharing 1/2; group b: 1 answer token with 1/2
    assert w.tolist() == pytest.approx([.125, .125, 0, 0, .125, .125, 0, 0, 0, 0, .5, 0])
    assert (targets != IGNORE).tolist() == (w > 0).tolist()
    assert pack(seqs)[3].tolist() == pytest.approx([.2, .2, 0, 0, .2, .2, 0, 0, 0, 0, .2, 0])
    with pytest.raises(ValueError, match="loss_balance"):
        DataConfig(loss_balance="sequence")
    # parts: group b weighs 3 to a's 1, so a's 4 tokens share 1/4 and b's one token has 3/4
    assert pack(seqs, ["a", "a", "b"], {"b": 3.0})[3].tolist() == pytest.approx(
        [1 / 16, 1 / 16, 0, 0, 1 / 16, 1 / 16, 0, 0, 0, 0, .75, 0])
    with pytest.raises(ValueError, match="loss_parts"):
        DataConfig(loss_parts={"recall": 0.0})
    with pytest.raises(ValueError, match="loss_parts"):
        DataConfig(loss_parts={"multiplication": 2.0})


def test_arithmetic_asked_in_words_keeps_its_answer():
    for inst in instances("addition", 20, "train", seed=3) + instances("subtraction", 20, "train", seed=3):
        q = as_question(inst)
        a, op, b = re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", q.prompt).groups()
        assert q.answer == inst.answer == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert inst.prompt == f"{a}{op}{b}="
    other = Instance("reversal", "reverse abc =", "cba")
    assert as_question(other) is other


def test_chat_arithmetic_comes_in_words_at_the_question_share(tokenizer):
    worded = {}
    for share in (0.0, 0.5, 1.0):
        c = DataConfig(tokens=8192, chat_share=1.0, question_share=share, weights={"addition": 1.0}, recall_share=0.0)
        step = TaskStream(c, tokenizer, seed=0).step(0, 1.0)
        text = tokenizer.decode(step.ids.tolist())
        n = step.tasks["addition"]
        worded[share] = text.count("What is ") / n
        assert text.count("<|user|>") == n  # every instance in the chat format
    assert worded[0.0] == 0 and worded[1.0] == 1 and 0.3 < worded[0.5] < 0.7
