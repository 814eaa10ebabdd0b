"""benchmarks/paged_attention.py at tiny sizes on the CPU (Triton's interpreter): every step gets a row with a
positive time, and decode rows their PyTorch comparison."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
from benchmarks.paged_attention import main  # noqa: E402


def test_table_at_tiny_sizes(tmp_path):
    report = main(["--device", "cpu", "--small", "--json", str(tmp_path / "attn.json")])
    assert [r["step"] for r in report["rows"]] == ["decode 3x1 @ 20", "decode 3x1 @ 20 w5", "prefill 1x40", "mixed 2x17"]
    assert all(r["ms"] > 0 and r["kv_gb_s"] > 0 for r in report["rows"])
    assert all(r["other_ms"] > 0 for r in report["rows"] if r["step"].startswith("decode"))
    assert (tmp_path / "attn.json").exists()
