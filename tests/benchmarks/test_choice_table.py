"""benchmarks/choice_table.py on the CPU: which builds it asks for (a measuring build, or with ``--resume`` one that
reads what an earlier, stopped run measured in the cache directory and keeps Triton's cache there), and ``--write``
merging a measured user table into the package's table for its GPU model."""
from __future__ import annotations

import json
import sys

import pytest

from benchmarks import choice_table as B
from dayzero.ops import choices as C

BUILD = {"seconds": 1.0, "prefill": 0.0, "decode": 0.0, "found": 0, "measured": 0, "table": None, "device": "cpu"}


def run_main(monkeypatch, *argv) -> list[tuple]:
    builds = []
    monkeypatch.setattr(B, "child", lambda config, args, mode, cache, triton_cache=None:
                        builds.append((mode, cache, triton_cache)) or dict(BUILD))
    monkeypatch.setattr(sys, "argv", ["choice_table.py", *argv])
    assert B.main() == 0
    return builds


def test_a_plain_run_measures_every_key_then_reads_the_table_with_empty_triton_caches(monkeypatch, tmp_path):
    builds = run_main(monkeypatch, "--cache-dir", str(tmp_path))
    assert builds == [("measure", str(tmp_path), None), ("table", str(tmp_path), None)]


def test_a_resumed_run_reads_what_the_cache_dir_holds_and_keeps_tritons_cache_there(monkeypatch, tmp_path):
    builds = run_main(monkeypatch, "--cache-dir", str(tmp_path), "--resume", "--measure-only")
    assert builds == [("table", str(tmp_path), str(tmp_path.resolve() / "triton"))]


def test_resume_without_a_cache_dir_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["choice_table.py", "--resume"])
    with pytest.raises(SystemExit):
        B.main()
    assert "--resume needs --cache-dir" in capsys.readouterr().err


def test_write_merges_the_measured_keys_into_the_package_table(monkeypatch, tmp_path):
    monkeypatch.setattr(C, "PACKAGE_TABLES", tmp_path / "package")
    table = {"device": "NVIDIA H200", "digest": C.digest(), "torch": "2.11", "triton": C.triton_version()}
    old = {**table, "choices": {"linear:a": [8, 256, 4], "linear:b": None}}
    (tmp_path / "package").mkdir()
    (tmp_path / "package" / "nvidia-h200.json").write_text(json.dumps(old))
    user = tmp_path / "user.json"
    user.write_text(json.dumps({**table, "choices": {"linear:b": [4, 128, 4], "linear:c": None}}))
    written = json.loads(B.write(user).read_text())
    assert written["choices"] == {"linear:a": [8, 256, 4], "linear:b": [4, 128, 4], "linear:c": None}
    assert written["digest"] == C.digest()
