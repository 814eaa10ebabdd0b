"""benchmarks/train_step.py at a tiny size on the CPU: both modes get a row with a positive rate; a mode out of
memory is reported and the other still runs."""
from __future__ import annotations

import torch

from benchmarks.train_step import main


def test_table_at_a_tiny_size(tiny_ckpt, capsys):
    report = main(["--device", "cpu", "--init", str(tiny_ckpt), "--tokens", "512", "--steps", "2", "--rounds", "1",
                   "--warmup-steps", "1"])
    assert [r["mode"] for r in report["rows"]] == ["reference ops", "fused (fla)"]
    assert all(r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 for r in report["rows"])
    assert report["rows"][0]["vs"] == 1.0 and report["step_flops"] > 0
    assert "vs reference" in capsys.readouterr().out


def test_a_mode_out_of_memory_is_reported_and_the_other_still_runs(tiny_ckpt, capsys, monkeypatch):
    import benchmarks.train_step as bench

    real = bench.job

    def job(init, device, data, steps, fused_mode, workers):
        if fused_mode == "off":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 244.00 MiB.")
        return real(init, device, data, steps, fused_mode, workers)

    monkeypatch.setattr(bench, "job", job)
    report = main(["--device", "cpu", "--init", str(tiny_ckpt), "--tokens", "512", "--steps", "2", "--rounds", "1",
                   "--warmup-steps", "1"])
    ref, fused = report["rows"]
    assert ref == {"mode": "reference ops", "error": "out of memory at 512 tokens a step"}
    assert fused["tokens_per_s"] > 0 and fused["vs"] is None
    out = capsys.readouterr().out
    assert "reference ops: out of memory at 512 tokens a step" in out
