"""One error path for the whole command line: one ``error: ...`` line, 2 for bad usage, 1 at run time,
130 when interrupted, the traceback only with -v / --debug."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dayzero import cli
from dayzero.ops import registry
from tests.conftest import CONFIGS, tiny_config

TINY = str(CONFIGS / "dayzero-tiny.json")


def run(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(map(str, argv)))
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_error_line(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_missing_model_is_one_line_for_every_command(capsys):
    for argv in (["generate", "--model", "/nope", "hi"], ["serve", "/nope"], ["inspect", "/nope"],
                 ["plan", "/nope", "--devices", "8xH200"], ["ops", "/nope"], ["profile", "/nope"],
                 ["align", "/nope"], ["quantize", "/nope", "/tmp/out"]):
        rc, out, err = run(capsys, *argv)
        line = one_error_line(err)
        assert rc == 2 and "no config.json at /nope" in line and "checkpoint directory" in line, (argv, err)


def test_generate_traceback_only_with_verbose():
    argv = [sys.executable, "-m", "dayzero", "generate", "--model", "/nope", "hi"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("error: no config.json at /nope")
    r = subprocess.run(argv + ["--debug"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith("error: ")


def test_bad_configs_are_usage_errors(tmp_path, capsys):
    cases = {"missing-key": {k: v for k, v in tiny_config().items() if k != "hidden_size"},
             "unknown-type": tiny_config(model_type="no_such_arch"), "not-an-object": [1, 2]}
    for name, cfg in cases.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(cfg))
    (tmp_path / "not-json.json").write_text("{bad")
    expect = {"missing-key": "missing key 'hidden_size'", "unknown-type": "unknown model_type 'no_such_arch'",
              "not-an-object": "a JSON object is needed", "not-json": "is not valid JSON"}
    for name, text in expect.items():
        rc, _, err = run(capsys, "inspect", tmp_path / f"{name}.json")
        line = one_error_line(err)
        assert rc == 2 and text in line and f"{name}.json" in line, (name, err)


def test_bad_arguments_are_one_line(capsys):
    for argv, text in ((["ops", TINY, "--platform", "cdua"], "unknown platform 'cdua'"),
                       (["profile", "--batch", "x"], "argument --batch"),
                       (["generate", "hi", "--threads", "0"], "argument --threads"),
                       (["align", "--lengths", "4,x"], "--lengths"),
                       (["nosuchcommand"], "invalid choice"),
                       ([], "required")):
        rc, _, err = run(capsys, *argv)
        assert rc == 2 and text in one_error_line(err), (argv, err)


def test_generate_needs_weights_or_dummy(capsys):
    rc, _, err = run(capsys, "generate", "--model", TINY, "hi")
    assert rc == 2 and "--load-format dummy" in one_error_line(err)
    dummy = ["generate", "--model", TINY, "--load-format", "dummy", "--device", "cpu", "--max-tokens", "2"]
    rc, out, err = run(capsys, *dummy, "hi")
    assert rc == 2 and "--token-ids" in one_error_line(err)
    rc, out, err = run(capsys, *dummy, "--token-ids", "1,17,42")
    assert rc == 0 and len(out.split()) == 2, err


def test_failure_at_run_time_exits_1(monkeypatch, capsys):
    def boom(self, *a, **k):
        raise RuntimeError("the step failed")

    monkeypatch.setattr("dayzero.engine.llm.LLM.generate", boom)
    rc, _, err = run(capsys, "generate", "hi", "--device", "cpu")
    assert rc == 1 and one_error_line(err) == "error: RuntimeError: the step failed (run with -v for the traceback)"
    rc, _, err = run(capsys, "generate", "hi", "--device", "cpu", "-v")
    assert rc == 1 and "Traceback" in err


def test_interrupt_exits_130(monkeypatch, capsys):
    def interrupted(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr("dayzero.engine.llm.LLM.generate", interrupted)
    rc, _, err = run(capsys, "generate", "hi", "--device", "cpu")
    assert rc == 130 and err.rstrip().endswith("interrupted")


@pytest.mark.parametrize("value,text", [
    ("kda_pooled=fast", "op kda_pooled has no 'fast' implementation"),
    ("bogus", "'bogus' is not op=platform"),
    ("kda_pooled=reference,no_such_op=reference", "unknown op 'no_such_op'"),
    ("kda_pooled=", "is not op=platform"),
], ids=["unknown-platform", "malformed", "unknown-op", "empty-platform"])
def test_bad_dayzero_ops_is_refused_before_loading(value, text, monkeypatch, capsys):
    monkeypatch.setenv("DAYZERO_OPS", value)
    with pytest.raises(ValueError, match=text):
        registry.env_overrides()
    for argv in (["generate", "hi"], ["ops", TINY], ["profile", TINY]):
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and text in one_error_line(err) and out == "", (argv, err)


def test_good_dayzero_ops_and_override_still_force(monkeypatch):
    monkeypatch.setenv("DAYZERO_OPS", " kda_pooled = reference , paged_mla=reference")
    assert registry.env_overrides() == {"kda_pooled": "reference", "paged_mla": "reference"}
    assert registry.choose("paged_mla", "cuda")[0:3:2] == ("reference", "forced")
    monkeypatch.delenv("DAYZERO_OPS")
    registry.override("moe_experts_grouped", "cuda")
    try:
        chosen, impl, why = registry.choose("moe_experts_grouped", "cpu", torch.zeros(1))
        assert (chosen, why) == ("cuda", "forced")
    finally:
        registry.override("moe_experts_grouped", None)
    assert registry.choose("moe_experts_grouped", "cpu", torch.zeros(1))[0] == "reference"
