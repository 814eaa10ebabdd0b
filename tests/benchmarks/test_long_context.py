"""benchmarks/long_context.py on the CPU with the tiny config: contexts past the config's maximum position run
through a raised copy of it, the engine built on the plan's cache budget admits the longest one, every
request decodes the tokens asked for, and the plan's memory figure comes with each row."""
from __future__ import annotations

import json

from benchmarks.long_context import long_config, main


def test_contexts_past_the_configs_maximum(tmp_path):
    out = tmp_path / "long.json"
    r = main(["--config", "configs/dayzero-tiny.json", "--device", "cpu", "--dtype", "float32",
              "--contexts", "40", "700", "--decode", "6", "--chunk", "128", "--json", str(out)])
    rows = r["rows"]
    assert [x["context"] for x in rows] == [40, 700]
    assert all(x["decode_tokens"] == 6 and x["prefill_s"] > 0 and x["decode_tok_s"] > 0 for x in rows)
    assert all(x["plan"]["memory_bytes"] > 0 for x in rows)
    assert json.loads(out.read_text())["rows"][1]["context"] == 700


def test_raised_config_scales_yarn(tmp_path):
    path = long_config("configs/dayzero-tiny.json", 700, str(tmp_path))
    raw = json.loads(open(path).read())
    assert raw["max_position_embeddings"] == 1024
    assert raw["rope_scaling"]["factor"] == 1024 / 128
    assert long_config("configs/dayzero-tiny.json", 512, str(tmp_path)) == "configs/dayzero-tiny.json"
