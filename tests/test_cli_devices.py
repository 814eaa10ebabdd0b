"""A device that is not there: one line naming what was asked and what exists, exit 2, for every command
and for ``LLM(device=...)``; ``ops --platform cuda`` without a GPU says where its probe runs."""
from __future__ import annotations

import json

import pytest
import torch

from dayzero import LLM, cli
from dayzero.engine.device import resolve_device
from tests.conftest import CONFIGS

TINY = str(CONFIGS / "dayzero-tiny.json")
COMMANDS = [["generate", "hi"], ["serve"], ["profile", TINY], ["align", TINY]]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def _refused(capsys, argv, asked: str) -> str:
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), (argv, err)
    assert f"device '{asked}' is not available" in err, err
    return err


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_cuda_without_a_gpu(argv, no_gpu, capsys):
    err = _refused(capsys, [*argv, "--device", "cuda"], "cuda")
    assert "this machine has: cpu" in err


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda a: a[0])
def test_gpu_index_past_the_devices(argv, one_gpu, capsys):
    err = _refused(capsys, [*argv, "--device", "cuda:3"], "cuda:3")
    assert "this machine has 1 CUDA device (cuda:0) and cpu" in err


def test_llm_raises_the_same_message(one_gpu):
    with pytest.raises(ValueError) as e:
        LLM(device="cuda:3")
    assert str(e.value) == "device 'cuda:3' is not available: this machine has 1 CUDA device (cuda:0) and cpu"


def test_llm_without_cuda(no_gpu):
    with pytest.raises(ValueError, match=r"^device 'cuda' is not available: .*; this machine has: cpu$"):
        LLM(device="cuda")


def test_device_spellings():
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("gpu", "cuda:x", "tpu:0"):
        with pytest.raises(ValueError, match="device must be 'auto', 'cpu', 'cuda' or 'cuda:N'"):
            resolve_device(bad)


def test_ops_for_cuda_without_a_gpu_says_the_probe_runs_on_the_cpu(no_gpu, capsys):
    assert cli.main(["ops", TINY, "--platform", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "the probe runs on the CPU because no GPU is present" in out and "capability" not in out
    assert cli.main(["ops", TINY, "--platform", "cuda", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert t["probe_device"] == "cpu" and "no GPU is present" in t["probe_note"]
    assert not any("capability" in why for r in t["ops"] for why in r["reasons"])
