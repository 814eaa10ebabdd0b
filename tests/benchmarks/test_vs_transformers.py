"""benchmarks/vs_transformers.py end to end on the CPU: tiny random checkpoints made by transformers, timed
through transformers and through dayzero, one row per batch size with numbers from both engines."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks.vs_transformers import CONFIGS, main  # noqa: E402

BATCHES = (1, 2)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_tiny_run(tmp_path, arch):
    out = tmp_path / "report.json"
    report = main(["--tiny", "--device", "cpu", "--arch", arch, "--batch", *map(str, BATCHES), "--prompt-len", "16",
                   "--decode", "4", "--repeat", "3", "--workdir", str(tmp_path / "ckpt"), "--json", str(out)])
    (entry,) = report["architectures"]
    for engine in ("transformers", "dayzero"):
        assert "error" not in entry[engine], f"{engine}: {entry[engine]['error']}"
    assert entry["finite_logits"]
    assert [r["batch"] for r in report["rows"]] == list(BATCHES)
    for r in report["rows"]:
        assert r["arch"] == arch and r["parameters"] > 0
        for key in ("hf_prefill_tok_s", "dz_prefill_tok_s", "hf_decode_tok_s", "dz_decode_tok_s", "decode_ratio"):
            assert r[key] is not None and r[key] > 0, f"batch {r['batch']}: {key} = {r[key]}"
    assert entry["same_tokens"] >= 1  # fp32: the same checkpoint gives the same first greedy token
    assert json.loads(out.read_text())["rows"] == report["rows"]
    assert report["environment"]["fla"].startswith(("importable", "not importable"))
