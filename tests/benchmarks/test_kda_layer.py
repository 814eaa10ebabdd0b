"""benchmarks/kda_layer.py at tiny sizes on the CPU: every step shape gets a row with a positive time."""
from __future__ import annotations

from benchmarks.kda_layer import main


def test_table_at_tiny_sizes(tmp_path):
    report = main(["--device", "cpu", "--small", "--json", str(tmp_path / "kda.json")])
    assert {(r["step"], r["seqs"]) for r in report["rows"]} == {("decode", 1), ("decode", 3), ("prefill", 1), ("prefill", 2)}
    assert all(r["ms"] > 0 and r["roof_ms"] > 0 for r in report["rows"])
    assert (tmp_path / "kda.json").exists()
