"""benchmarks/prefill_steps.py on the CPU with the tiny config: every length is timed (eagerly: no graphs without
a GPU), the roofline comes with each row, and the host profile is written."""
from __future__ import annotations

import json

from benchmarks.prefill_steps import main


def test_lengths_timed_and_host_profile_written(tmp_path):
    out, prof = tmp_path / "prefill.json", tmp_path / "host.txt"
    r = main(["--config", "configs/dayzero-tiny.json", "--device", "cpu", "--dtype", "float32", "--lengths", "5", "40",
              "--repeats", "2", "--cprofile", str(prof), "--cprofile-len", "20", "--json", str(out)])
    rows = r["rows"]
    assert [x["tokens"] for x in rows] == [5, 40]
    assert all(x["eager_ms"] > 0 and x["roofline_ms"] > 0 and "graphs_ms" not in x for x in rows)
    assert "need a CUDA device" in r["prefill_mode"]
    assert "cumulative" in prof.read_text() and "model_runner.py" in prof.read_text()
    assert json.loads(out.read_text())["rows"][1]["tokens"] == 40
