"""Choice tables: per-shape kernel choices kept per GPU model, read only for the kernels they were measured with."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch

from dayzero.ops import choices as C

GPU = "NVIDIA H200"
KEY = (1, 1536, 2048, torch.bfloat16, torch.bfloat16, torch.bfloat16, None, None, torch.device("cpu"))


def tables(tmp_path: Path, name: str = GPU) -> C.ChoiceTables:
    return C.ChoiceTables(name, user=tmp_path / "user", package=tmp_path / "package")


def package_table(tmp_path: Path, choices: dict, **fields) -> Path:
    path = tmp_path / "package" / C.file_name(GPU)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": GPU, "digest": C.digest(), "choices": choices, **fields}))
    return path


def test_a_key_is_written_by_op_and_values_with_dtypes_by_name_and_no_device():
    text = C.key_text("linear", KEY)
    assert text == "linear:1,1536,2048,bfloat16,bfloat16,bfloat16,None,None"
    assert C.key_text("linear", KEY[:-1] + (torch.device("cuda", 1),)) == text  # one table a GPU model
    assert C.key_text("rms_norm_linear", KEY) != text
    assert C.file_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3.json"


def test_a_measured_choice_is_read_back_by_the_next_process(tmp_path):
    first = tables(tmp_path)
    assert first.get("linear", KEY) == (False, None)
    first.add("linear", KEY, (16, 256, 4, 4))
    first.add("act_linear", KEY + ("silu", None), None)
    assert first.measured == 2
    second = tables(tmp_path)  # a new process: the user's table on disk
    assert second.get("linear", KEY) == (True, (16, 256, 4, 4))
    assert second.get("act_linear", KEY + ("silu", None)) == (True, None)  # the ops apart, found
    assert second.found == 2
    assert tables(tmp_path, "NVIDIA H100 80GB HBM3").get("linear", KEY) == (False, None)  # another GPU model


def test_two_processes_adding_keep_both_choices(tmp_path):
    a, b = tables(tmp_path), tables(tmp_path)
    a.add("linear", KEY, (8, 256, 4))
    b.add("linear", (2,) + KEY[1:], (32, 128, 4, 4))
    c = tables(tmp_path)
    assert c.get("linear", KEY) == (True, (8, 256, 4))
    assert c.get("linear", (2,) + KEY[1:]) == (True, (32, 128, 4, 4))


def test_the_package_table_is_read_and_the_users_wins_on_a_key_in_both(tmp_path):
    package_table(tmp_path, {C.key_text("linear", KEY): [16, 256, 4, 4],
                             C.key_text("linear", (4,) + KEY[1:]): None})
    tables(tmp_path).add("linear", KEY, (64, 128, 4, 3))
    t = tables(tmp_path)
    assert t.get("linear", KEY) == (True, (64, 128, 4, 3))
    assert t.get("linear", (4,) + KEY[1:]) == (True, None)


def test_a_table_of_other_kernels_or_another_gpu_is_not_read(tmp_path, caplog):
    path = package_table(tmp_path, {C.key_text("linear", KEY): [16, 256, 4, 4]}, digest="0" * 16)
    with caplog.at_level(logging.INFO, logger="dayzero.ops"):
        assert tables(tmp_path).get("linear", KEY) == (False, None)
    assert "other kernels" in caplog.text
    path.write_text(json.dumps({"device": "NVIDIA B200", "digest": C.digest(),
                                "choices": {C.key_text("linear", KEY): [16, 256, 4, 4]}}))
    with caplog.at_level(logging.WARNING, logger="dayzero.ops"):
        assert C.read(path, GPU) == {}
    assert "measured on NVIDIA B200" in caplog.text


@pytest.mark.parametrize("content", ["{not json", '{"device": "NVIDIA H200"}', '{"choices": [1, 2]}',
                                     "DIGEST [16, 256, 0, 4]", "DIGEST [16, 256]", 'DIGEST "cuBLAS"',
                                     "DIGEST [16, 256, true]"], ids=str)
def test_a_table_that_cannot_be_read_is_skipped_with_a_warning_and_its_keys_measured(tmp_path, caplog, content):
    path = tmp_path / "package" / C.file_name(GPU)
    path.parent.mkdir(parents=True)
    if content.startswith("DIGEST "):
        value = json.loads(content.removeprefix("DIGEST "))
        content = json.dumps({"device": GPU, "digest": C.digest(), "choices": {C.key_text("linear", KEY): value}})
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="dayzero.ops"):
        t = tables(tmp_path)
    assert t.get("linear", KEY) == (False, None)
    assert str(path) in caplog.text
    t.add("linear", KEY, (8, 256, 4))  # the build goes on, and the user's table takes the measurement
    assert tables(tmp_path).get("linear", KEY) == (True, (8, 256, 4))


def test_measure_reads_no_table_but_records_and_off_does_neither(tmp_path, monkeypatch):
    package_table(tmp_path, {C.key_text("linear", KEY): [16, 256, 4, 4]})
    monkeypatch.setenv("DAYZERO_CHOICES", "measure")
    t = tables(tmp_path)
    assert t.get("linear", KEY) == (False, None)
    t.add("linear", KEY, (8, 256, 4))
    monkeypatch.setenv("DAYZERO_CHOICES", "off")
    off = tables(tmp_path)
    assert off.get("linear", KEY) == (False, None)
    off.add("linear", (2,) + KEY[1:], (8, 256, 4))
    monkeypatch.delenv("DAYZERO_CHOICES")
    t = tables(tmp_path)
    assert t.get("linear", KEY) == (True, (8, 256, 4))  # the user's, measured under "measure"
    assert t.get("linear", (2,) + KEY[1:]) == (False, None)  # not written under "off"
    monkeypatch.setenv("DAYZERO_CHOICES", "tabel")
    with pytest.raises(ValueError, match="DAYZERO_CHOICES='tabel'.*table, measure, off"):
        tables(tmp_path)


def test_a_cache_folder_that_cannot_be_written_is_warned_about_once(tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder should be
    t = C.ChoiceTables(GPU, user=blocked / "choices", package=tmp_path / "package")
    with caplog.at_level(logging.WARNING, logger="dayzero.ops"):
        t.add("linear", KEY, (8, 256, 4))
        t.add("linear", (2,) + KEY[1:], (8, 256, 4))
    assert caplog.text.count("cannot be written") == 1
    assert t.get("linear", KEY) == (True, (8, 256, 4))  # this process keeps it


def test_the_digest_covers_every_module_that_measures_a_choice():
    ops = Path(C.__file__).parent
    measuring = {str(p.relative_to(ops)) for p in ops.rglob("*.py")
                 if re.search(r"\bmeasure_once\(", p.read_text()) or re.search(r"\bfused_timings\(", p.read_text())}
    assert measuring and measuring <= set(C.SOURCES), measuring - set(C.SOURCES)


def test_every_shipped_table_was_measured_with_these_kernels():
    """A package table is read only while the kernels keep its digest: a change to them leaves it unread, so it
    must be measured again on its GPU (``benchmarks/choice_table.py --write``) or removed."""
    shipped = sorted(C.PACKAGE_TABLES.glob("*.json"))
    assert shipped  # the H100's, measured 2026-12-06
    for path in shipped:
        table = json.loads(path.read_text())
        assert path.name == C.file_name(table["device"]), path.name
        assert table["digest"] == C.digest_with(table["triton"]), (
            f"{path.name} was measured with other kernels: run benchmarks/choice_table.py --write on a "
            f"{table['device']} or remove it")
        assert table["choices"] and all(C.valid(v) for v in table["choices"].values())


def test_a_written_table_records_the_triton_version_its_digest_holds(tmp_path):
    t = tables(tmp_path)
    t.add("linear", KEY, (8, 256, 4))
    table = json.loads(t.path.read_text())
    assert table["triton"] == C.triton_version()
    assert C.digest_with(table["triton"]) == table["digest"] == C.digest()
    assert C.digest_with("0.0.0") != C.digest()


def test_on_the_cpu_no_table_is_read_or_written(tmp_path, monkeypatch):
    from dayzero.ops.linear import kernels as L

    monkeypatch.setenv("DAYZERO_CACHE_DIR", str(tmp_path))
    calls = []
    assert L.measure_once({}, KEY, torch.device("cpu"), lambda: calls.append(1), "linear") is None
    assert not calls and not any(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_a_tables_choice_is_taken_without_measuring(tmp_path, monkeypatch):
    from dayzero.ops.linear import kernels as L

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    t = C.ChoiceTables(name, user=tmp_path, package=tmp_path / "package")
    t.add("linear", KEY, (8, 256, 4))
    monkeypatch.setitem(C._TABLES, name, C.ChoiceTables(name, user=tmp_path, package=tmp_path / "package"))
    calls = []
    assert L.measure_once({}, KEY, dev, lambda: calls.append(1), "linear") == (8, 256, 4)
    assert not calls
    assert L.measure_once({}, (2,) + KEY[1:], dev, lambda: calls.append(1) or (4, 256, 4), "linear") == (4, 256, 4)
    assert calls == [1]
    assert C.ChoiceTables(name, user=tmp_path).get("linear", (2,) + KEY[1:]) == (True, (4, 256, 4))
