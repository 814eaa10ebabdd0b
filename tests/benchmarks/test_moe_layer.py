"""benchmarks/moe_layer.py on the CPU through Triton's interpreter: the table at tiny sizes, and ``--tune`` writing
a table that the kernels then read."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("triton")

from benchmarks.moe_layer import main  # noqa: E402
from dayzero.ops.moe import triton_moe as T  # noqa: E402


def test_table_at_tiny_sizes(tmp_path):
    out = tmp_path / "moe.json"
    report = main(["--device", "cpu", "--small", "--tokens", "1", "4", "--repeats", "1", "--json", str(out)])
    names = {r["variant"] for r in report["rows"]}
    assert {"triton-bf16", "triton-fp8", "triton-mxfp4", "convert", "reference", "triton-fp8tile",
            "triton-fp8tile-a8", "direct-fp8tile-a8"} <= names  # no grouped_mm on a CPU
    for r in report["rows"]:
        assert r["ms"] > 0 and r["gbs"] >= 0, r
    assert json.loads(out.read_text())["rows"] == report["rows"]


def test_tune_writes_a_table_the_kernels_read(tmp_path, monkeypatch):
    path = tmp_path / "configs.json"
    main(["--device", "cpu", "--small", "--tune", "--tune-out", str(path), "--tokens", "1", "--repeats", "1"])
    configs = json.loads(path.read_text())["configs"]
    assert set(configs) == {T.table_key(f, 4, 64, 32) for f in ("bfloat16", "fp8_block", "mxfp4")}
    monkeypatch.setattr(T, "CONFIGS", path)
    T._table.cache_clear()
    try:
        (entry,) = configs["mxfp4,E4,L64,I32"].values()
        got = T.config_for("mxfp4", 2, 4, 64, 32, device="cpu")
        assert [list(vars(got.up).values()), list(vars(got.down).values())] == [entry["up"], entry["down"]]
        # a table tuned on another device model is not applied here
        assert T.config_for("mxfp4", 2, 4, 64, 32, device="NVIDIA H200") == T.default_config(2, 4)
    finally:
        T._table.cache_clear()
