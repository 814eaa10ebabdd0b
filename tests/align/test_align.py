"""``dayzero align``: fp32 against both references passes, a corrupted layer is found, bf16 reports errors."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dayzero import cli
from dayzero.tools import align_hf
from dayzero.tools.align import Capture, align, compare
from dayzero.tools.align_report import format_report, plot
from tests.hf.harness import make_hf_checkpoint
from tests.hf.test_moe_families import COMMON, FAMILIES

SHORT = ["--lengths", "7,40", "--device", "cpu"]  # 40 > the tiny DSA top-k (8): sparse attention runs


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["align", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_fp32_matches_fp32_reference_with_text_prompts(tiny_ckpt, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\njumps over the lazy dog, twice.\n")
    precision = tmp_path / "precision.json"  # its keys go to LLM(...)
    precision.write_text(json.dumps({"dtype": "float32", "block_size": 8}))
    rc, out, err = run_cli(capsys, tiny_ckpt, "--precision", precision, "--prompts", prompts, "--device", "cpu", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["reference"] == "fp32" and r["dtype"] == "float32" and r["precision"] == {"block_size": 8}
    assert r["threshold"] == 1e-3 and r["passed"]
    assert r["prompt_lengths"] == [19, 31]  # byte-level tokenizer, the empty line skipped
    assert [row["kind"] for row in r["rows"]] == ["kda+dense", "dsa+moe", "kda+moe", "gqa+moe"]
    assert all(row["passed"] and row["rel_err"] <= 1e-6 for row in r["rows"])
    assert r["top1"] == 1.0 and r["kl_max"] <= 1e-9 and r["first_failing"] is None and r["suggestions"] == []


def test_unknown_precision_key_is_refused_by_llm(tiny_ckpt, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"no_such_option": 1}))
    rc, out, err = run_cli(capsys, tiny_ckpt, "--precision", bad, *SHORT)
    assert rc == 2 and "no_such_option" in err and out == ""


@pytest.fixture(scope="module")
def deepseek_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    make_hf_checkpoint(path, "deepseek_v3", **COMMON, **FAMILIES["deepseek_v3"])
    return path


def test_fp32_matches_transformers_deepseek_v3(deepseek_ckpt, capsys):
    rc, out, err = run_cli(capsys, deepseek_ckpt, "--reference", "hf", "--dtype", "float32", *SHORT, "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["reference"] == "hf" and len(r["rows"]) == 3
    assert [row["kind"] for row in r["rows"]] == ["mla+dense", "mla+moe", "mla+moe"]
    # the last row is the residual stream before the final norm (taken from the norm's input), not after it
    assert all(row["rel_err"] <= 1e-5 and row["note"] == "" for row in r["rows"]), r["rows"]
    assert r["top1"] == 1.0 and r["kl_max"] <= 1e-8 and r["logits_rel_err"] <= 1e-5


def test_transformers_reference_without_a_findable_norm(deepseek_ckpt, monkeypatch):
    """transformers' last hidden state is after the final norm: compared against ours after the final norm."""
    monkeypatch.setattr(align_hf, "final_norm", lambda model: None)
    r = align(deepseek_ckpt, reference="auto", dtype="float32", device="cpu", lengths=(7, 40))
    assert r.reference == "hf" and r.passed
    assert r.rows[-1].note == "after final norm" and r.rows[-1].rel_err <= 1e-5
    assert all(row.note == "" for row in r.rows[:-1])


def corrupt(src, dst, layer: int, scale: float = 1.5):
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    name = f"model.layers.{layer}.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * scale
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("layer", [1, 3], ids=lambda k: f"layer{k}")
def test_corrupted_layer_is_the_first_failing(tiny_ckpt, tmp_path, capsys, layer):
    bad = tmp_path / "bad"
    corrupt(tiny_ckpt, bad, layer)
    rc, out, err = run_cli(capsys, bad, "--reference-model", tiny_ckpt, "--dtype", "float32", *SHORT, "--json")
    assert rc == 1, err
    r = json.loads(out)
    assert r["first_failing"] == layer and layer in r["suggestions"] and not r["passed"]
    assert all(row["passed"] and row["rel_err"] == 0 for row in r["rows"][:layer])
    assert r["rows"][layer]["rel_err"] > 1e-2


@pytest.fixture(scope="module")
def bf16(tiny_ckpt):
    return align(tiny_ckpt, device="cpu", lengths=(7, 40))


def test_bf16_reports_per_layer_errors(bf16):
    assert bf16.dtype == "bfloat16" and bf16.threshold == 5e-2 and len(bf16.rows) == 4
    assert all(row.rel_err > 0 and row.max_abs > 0 and 0.9 < row.cosine < 1 for row in bf16.rows)
    assert 0 <= bf16.top1 <= 1 and 0 < bf16.kl_mean <= bf16.kl_max < math.inf
    text = format_report(bf16)
    for row in bf16.rows:
        assert f"{row.index:>5}  {row.kind}" in text
    assert "first layer over threshold" in text and "top-1 agreement" in text


def test_bf16_plot_and_json(bf16, tmp_path):
    png = tmp_path / "align.png"
    plot(bf16, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    r = json.loads(bf16.to_json())
    assert len(r["rows"]) == 4 and all(row["rel_err"] > 0 for row in r["rows"]) and 0 <= r["top1"] <= 1
    assert r["passed"] == (r["first_failing"] is None) and set(r["by_kind"]) == {row["kind"] for row in r["rows"]}


def test_threshold_override_fails_the_run_and_plots(tiny_ckpt, tmp_path, capsys):
    png = tmp_path / "align.png"
    rc, out, err = run_cli(capsys, tiny_ckpt, "--device", "cpu", "--lengths", "9", "--threshold", "1e-6", "--plot", png)
    assert rc == 1 and "first layer over threshold: 0 (kda+dense" in out and "FAIL" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "plot written" in err


def fake(errors: list[float], T: int = 6, D: int = 8) -> tuple[Capture, Capture]:
    """Captures whose layer i differs from the reference by relative error ``errors[i]``."""
    g = torch.Generator().manual_seed(0)
    ref = [torch.randn(T, D, generator=g) for _ in errors]
    ours = []
    for r, e in zip(ref, errors):
        noise = torch.randn(T, D, generator=g)
        ours.append(r + noise * (e * r.norm() / noise.norm()))
    logits = torch.randn(T, 11, generator=g)
    return Capture(ours, None, logits), Capture(ref, None, logits)


def test_jump_and_failures_are_suggested():
    kinds = ["kda+moe", "kda+moe", "dsa+moe", "kda+moe", "kda+moe"]
    o, r = fake([1e-4, 1.2e-4, 4e-3, 5e-3, 2e-2])
    rows, first, jump, suggestions, end = compare([o], [r], kinds, threshold=1e-2, jump_factor=4.0)
    assert [round(x.rel_err, 6) for x in rows] == [1e-4, 1.2e-4, 4e-3, 5e-3, 2e-2]
    assert first == 4 and jump == 2 and suggestions == [2, 4]
    assert end["top1"] == 1.0 and end["kl_max"] == 0.0


def test_small_jumps_and_nan_layers():
    o, r = fake([1e-7, 1e-6, 1e-6])  # a x10 jump far below the threshold is noise, not advice
    rows, first, jump, suggestions, _ = compare([o], [r], ["gqa+dense"] * 3, threshold=1e-3, jump_factor=4.0)
    assert first is None and jump is None and suggestions == []
    o.layers[1][0, 0] = float("nan")
    rows, first, jump, suggestions, _ = compare([o], [r], ["gqa+dense"] * 3, threshold=1e-3, jump_factor=4.0)
    assert first == 1 and not rows[1].passed and 1 in suggestions


def test_fp32_matches_transformers_deepseek_v4_streams(tmp_path, capsys):
    """Hyper-connection models: every layer, the last included, is compared as its n streams (the last from
    the input of transformers' hc_head), and a token's streams count as one vector in the cosine."""
    from tests.hf.test_deepseek_v4 import CONFIG, _init

    make_hf_checkpoint(tmp_path, "deepseek_v4", init=_init, **CONFIG)
    rc, out, err = run_cli(capsys, tmp_path, "--reference", "hf", "--dtype", "float32", "--lengths", "7,70",
                           "--device", "cpu", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert [row["kind"] for row in r["rows"]] == ["swa+moe", "csa+moe", "hca+moe", "csa+moe", "hca+moe"]
    assert all(row["rel_err"] <= 1e-5 and row["note"] == "" for row in r["rows"]), r["rows"]
    assert all(abs(row["cosine"] - 1) <= 1e-6 for row in r["rows"])
    assert r["top1"] == 1.0 and r["logits_rel_err"] <= 1e-5
