"""benchmarks/vision_throughput.py with its tiny model on the CPU: both engines run every batch size on the same
image prompts, count the same prompt tokens (the image's included) and give positive rates."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers.models.qwen3_5_moe")
from benchmarks.vision_throughput import main  # noqa: E402


def test_tiny_run(tmp_path):
    r = main(["--tiny", "--device", "cpu", "--batch", "1", "2", "--image-size", "64", "--decode", "3",
              "--json", str(tmp_path / "v.json")])
    assert [row["batch"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        hf, dz = row["transformers"], row["dayzero"]
        assert hf["prompt_tokens"] == dz["prompt_tokens"] > 2 * 64 + 3  # text, brackets and the image's tokens
        assert dz["prefill_tok_s"] > 0 and dz["decode_tok_s"] > 0 and hf["prefill_tok_s"] > 0
        assert len(dz["tokens"]) == 4
    assert (tmp_path / "v.json").exists()
