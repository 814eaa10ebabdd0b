"""The recall probe: the spans it labels are the prompt's pairs, its attention weights are distributions, its
zeroing hook changes the attention layers' outputs within its block only."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero.engine.tokenizer import load_tokenizer
from dayzero.eval.tasks import instances
from dayzero.train.attention import probing
from dayzero.train.batch import TrainBatch
from dayzero.train.checkpoint import load_model
from dayzero.train.forward import training
from dayzero.train.probe import PARTS, probe_recall, spans, table


@pytest.mark.parametrize("style, sep", [("letter", "="), ("joined", ""), ("assign", "=")])
def test_spans_are_the_asked_pair_and_the_others(style, sep):
    for inst in instances("recall", 4, context_len=300, style=style):
        asked, others, question = spans(inst.prompt, inst.answer, style)
        key = inst.prompt[question:].split("? ")[1].rstrip("=")
        assert inst.prompt[slice(*asked)] == f"{key}{sep}{inst.answer}."
        assert len(others) == 7 and asked not in others
        assert all(inst.prompt[e - 1] == "." and inst.prompt[e - 5:e - 1].isdigit() for _, e in others)
        assert inst.prompt[question:].startswith("\nWhat is")


def test_probe_weights_are_distributions(tiny_ckpt):
    tok = load_tokenizer(tiny_ckpt)
    model = load_model(tiny_ckpt, torch.device("cpu")).eval()
    kinds = json.loads((tiny_ckpt / "config.json").read_text())["layer_types"]
    assert kinds.count("dsa") and kinds.count("gqa")  # both attention kinds go through the probe
    for sparse in (False, True):
        p = probe_recall(model, tok, 96, n=3, style="joined", sparse=sparse)
        assert p.n == 3 and 0 <= p.first_right <= 3 and 0 <= p.first_right_ablated <= 3
        assert p.mass and all(m.shape[1] == len(PARTS) for m in p.mass)
        assert len(p.mass) == kinds.count("dsa") + kinds.count("gqa")
        for m in p.mass:  # every head's last-row weights sum to one over the four parts
            assert torch.all(m >= 0) and torch.allclose(m.sum(1), torch.ones(m.shape[0]), atol=1e-4)
    text = table([p])
    assert "first digit" in text and "attn 0: asked" in text and text.splitlines()[2].split()[0] == "96"


def test_probing_hook_replaces_outputs_inside_its_block_only(tiny_ckpt):
    model = load_model(tiny_ckpt, torch.device("cpu")).eval()
    ids = torch.arange(40) % 200

    def run():
        with torch.no_grad(), training(model):
            return model(TrainBatch(ids, [40], sparse=False))

    calls = []
    before = run()
    with probing(lambda q, k, scale, mask, out: calls.append(out.shape) or torch.zeros_like(out)):
        zeroed = run()
    after = run()
    assert calls and not torch.allclose(zeroed, before)
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def _script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "recall_probe.py"
    spec = importlib.util.spec_from_file_location("recall_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_prints_a_row_per_length_and_writes_the_plot(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "probe.png"
    assert _script().main([str(tiny_ckpt), "--contexts", "80", "120", "--n", "2", "--recall-style", "joined",
                           "--plot", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines[3:5]] == ["80", "120"]
    assert out.stat().st_size > 1000 and out.read_bytes()[:4] == b"\x89PNG"


def test_script_refuses_a_checkpoint_without_tokenizer_and_bad_lengths(tiny_ckpt, tiny_ckpt_no_tokenizer, capsys):
    with pytest.raises(SystemExit):
        _script().main([str(tiny_ckpt_no_tokenizer), "--n", "1"])
    assert "no tokenizer files" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _script().main([str(tiny_ckpt), "--contexts", "32"])
    assert "at least 64 tokens" in capsys.readouterr().err
