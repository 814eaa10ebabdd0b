"""benchmarks/train_step.py at a tiny size on the CPU: both modes get a row with a positive rate."""
from __future__ import annotations

from benchmarks.train_step import main


def test_table_at_a_tiny_size(tiny_ckpt, capsys):
    report = main(["--device", "cpu", "--init", str(tiny_ckpt), "--tokens", "512", "--steps", "2", "--rounds", "1",
                   "--warmup-steps", "1"])
    assert [r["mode"] for r in report["rows"]] == ["reference ops", "fused (fla)"]
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in report["rows"])
    assert report["rows"][0]["vs"] == 1.0 and report["step_flops"] > 0
    assert "vs reference" in capsys.readouterr().out
