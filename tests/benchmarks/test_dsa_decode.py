"""benchmarks/dsa_decode.py at tiny shapes on the CPU (Triton's interpreter): every decode row and the prefill's
indexer and sparse MLA chunk get positive times, the indexer's scratch stays under its budget, and each prefill
row selects at most top-k keys."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
from benchmarks.dsa_decode import main  # noqa: E402


def test_table_at_tiny_shapes(tmp_path):
    r = main(["--device", "cpu", "--small", "--config", "configs/dayzero-small.json", "--contexts", "40",
              "--batch", "1", "--prefill-tokens", "48", "--prefill-chunk", "16", "--json", str(tmp_path / "dsa.json")])
    assert [(d["context"], d["batch"]) for d in r["decode"]] == [(40, 1)]
    assert all(v > 0 for v in r["decode"][0]["ms"].values())
    p = r["prefill"]
    assert p["ms"] > 0 and p["scratch_bytes"] <= p["budget"] and p["chunks"] >= 2
    m = p["mla"]
    assert m["rows"] == 16 and m["ms"] > 0 and 0 < m["selected_keys"] <= 16 * r["shapes"]["topk"]
    assert (tmp_path / "dsa.json").exists()


@pytest.mark.parametrize("cache", ["fp8", "int8"])
def test_quantised_decode_pools(cache):
    """``--cache fp8 / int8``: the decode pools as a quantised KV cache stores them; a row's bytes are its codes
    and a bf16 scale."""
    r = main(["--device", "cpu", "--small", "--config", "configs/dayzero-small.json", "--contexts", "40",
              "--batch", "1", "--prefill-tokens", "0", "--cache", cache])
    (d,) = r["decode"]
    assert all(v > 0 for v in d["ms"].values())
    s = r["shapes"]
    assert d["bytes"]["dense_mla"] == 40 * (s["R"] + s["P"] + 2) and d["bytes"]["indexer"] == 40 * (s["Di"] + 2)
