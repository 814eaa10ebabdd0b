"""Slow tools say what they do on stderr, and profile and align report what they measured when interrupted."""
from __future__ import annotations

import json

import pytest

from dayzero import cli
from dayzero.tools import align_capture
from dayzero.tools.profile import Profiler
from tests.conftest import CONFIGS

TINY = str(CONFIGS / "dayzero-tiny.json")
PROFILE = ["profile", TINY, "--prompt-len", "12", "--steps", "2", "--repeats", "2", "--device", "cpu"]


def interrupt_nth(monkeypatch, owner, name: str, at: int) -> None:
    """Ctrl-C on the ``at``-th call (1-based) of ``owner.name``."""
    calls = [0]
    fn = getattr(owner, name)

    def counted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return fn(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def _interrupt_step(monkeypatch, at: int) -> None:
    """Ctrl-C on the ``at``-th step the profiler runs."""
    interrupt_nth(monkeypatch, Profiler, "step", at)


def test_profile_shows_its_stages(capsys):
    assert cli.main(PROFILE) == 0
    err = capsys.readouterr().err
    assert "profile: building dayzero-tiny with random weights" in err and "profile: warm-up" in err
    assert "0/12" in err  # the bar over the measured steps: 2 rounds x 2 phases x 3 kinds of timing


def test_profile_interrupted_prints_what_it_measured(monkeypatch, capsys):
    # warm-up: 3 modes x (1 prefill step + 1 prefill and 2 decode steps) = 12; round 1: 3 prefill steps, then
    # the decode phases: interrupted there, prefill is measured in every mode and decode in none
    _interrupt_step(monkeypatch, 12 + 3 + 1)
    rc = cli.main([*PROFILE, "--json"])
    out = capsys.readouterr()
    assert rc == 130 and "interrupted: 0 of 2 rounds complete" in out.err
    r = json.loads(out.out)
    assert r["interrupted"] and r["phases"] == ["prefill"] and r["decode"] is None
    assert r["prefill"]["step_s"] > 0 and all(l["prefill_s"] > 0 and l["decode_s"] is None for l in r["layers"])
    _interrupt_step(monkeypatch, 12 + 3 + 1)
    assert cli.main(PROFILE) == 130
    text = capsys.readouterr().out
    assert "interrupted after 0 of 2 rounds" in text and "measured: prefill" in text


def test_profile_interrupted_in_warm_up_has_nothing_to_report(monkeypatch, capsys):
    _interrupt_step(monkeypatch, 2)
    assert cli.main(PROFILE) == 130
    out = capsys.readouterr()
    assert out.out == "" and out.err.rstrip().endswith("interrupted")


def test_align_on_a_bare_config_shows_progress_and_passes_in_fp32(capsys):
    rc = cli.main(["align", TINY, "--lengths", "5,20", "--dtype", "float32", "--device", "cpu", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    r = json.loads(out.out)
    assert r["random_weights"] and r["reference"] == "fp32" and r["passed"]
    assert "align: loading the model under test" in out.err and "align: running the fp32 reference" in out.err


def test_align_bare_config_refuses_the_transformers_reference(capsys):
    assert cli.main(["align", TINY, "--reference", "hf"]) == 2
    assert "has no weights for transformers to load" in capsys.readouterr().err


@pytest.mark.parametrize("interrupt_at,rc", [(4, 130), (2, 130)], ids=["reference", "model-under-test"])
def test_align_interrupted(monkeypatch, capsys, interrupt_at, rc):
    interrupt_nth(monkeypatch, align_capture, "run_engine", interrupt_at)
    assert cli.main(["align", TINY, "--lengths", "7,30", "--device", "cpu", "--json"]) == rc
    out = capsys.readouterr()
    if interrupt_at == 4:  # the reference's second prompt: the first is compared
        r = json.loads(out.out)
        assert r["interrupted"] and r["prompt_lengths"] == [7] and r["prompts_planned"] == 2
        assert "interrupted: 1 of 2 prompts compared" in out.err
    else:  # nothing to compare yet
        assert out.out == "" and out.err.rstrip().endswith("interrupted")


def test_ops_shows_its_stages(capsys):
    assert cli.main(["ops", TINY]) == 0
    err = capsys.readouterr().err
    assert "ops: building the probe of dayzero-tiny" in err and "ops: decode step of the probe" in err
