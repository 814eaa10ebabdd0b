"""What the tools write: quantize's file modes, plan's reason when nothing fits, the profile plot's axes."""
from __future__ import annotations

import os
import stat

import pytest

from dayzero import cli
from dayzero.tools.build_default_model import build_checkpoint
from dayzero.tools.profile_report import figure
from tests.conftest import CONFIGS, tiny_config


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o640
    os.umask(old)


def test_quantize_writes_weights_with_the_umask_mode(tmp_path, umask_027, capsys):
    src = build_checkpoint(tmp_path / "src", tiny_config(moe_latent_size=64, moe_intermediate_size=32), tokenizer=False)
    dst = tmp_path / "q"
    assert cli.main(["quantize", str(src), str(dst)]) == 0
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in dst.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == umask_027, modes


def test_plan_says_when_the_weights_alone_do_not_fit(capsys):
    assert cli.main(["plan", str(CONFIGS / "dayzero-2.8t.json"), "--devices", "2xH200"]) == 1
    out = capsys.readouterr().out
    assert "no layout fits: the weights alone need" in out and "more devices" in out
    assert cli.main(["plan", str(CONFIGS / "dayzero-small.json"), "--devices", "1xH100", "--batch", "4096"]) == 1
    out = capsys.readouterr().out
    assert "weights alone" not in out and "the longest context any layout fits" in out


def _result(kinds: list[str], heights: list[float], phases=("prefill", "decode")) -> dict:
    layers = [{"index": i, "kind": k, **{f"{ph}_parts": {"attention": h / 2, "other": h / 2} for ph in phases}}
              for i, (k, h) in enumerate(zip(kinds, heights))]
    summary = {"step_s": sum(heights), "layers_sum_s": sum(heights)}
    return {"model": "m", "device": "cpu", "prompt_len": 8, "batch": 1, "phases": list(phases), "interrupted": False,
            "layers": layers, **{ph: summary for ph in phases}}


def test_profile_plot_names_each_bar_and_fits_the_tallest():
    kinds = ["kda+dense", "dsa+moe", "kda+moe", "gqa+moe"]
    fig = figure(_result(kinds, [0.001, 0.004, 0.0025, 0.002]))
    labels = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert labels == [f"{i} {k}" for i, k in enumerate(kinds)]
    for ax in fig.axes[:2]:
        assert ax.get_ylim()[1] > 4.0  # ms: the tallest stacked bar, with headroom
    one = figure(_result(kinds, [0.001] * 4, phases=("prefill",)))  # an interrupted profile: one panel
    assert len([a for a in one.axes if a.get_ylabel()]) == 1
