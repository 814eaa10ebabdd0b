"""benchmarks/kda_decode.py --chain on the CPU (Triton's interpreter, tiny shapes): the kernel behind the input
projection, layer after layer, gives the same outputs at every split of a head's columns."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.kda_decode import main  # noqa: E402


def test_the_chain_runs_every_split_and_they_agree():
    rows = main(["--chain", "2", "--batch", "2", "--heads", "2", "--head-dim", "32", "--hidden", "64",
                 "--splits", "1", "2", "4"])
    assert [r["splits"] for r in rows] == [1, 2]  # 4 would split 32 columns finer than MIN_COLS
    assert all(r["max_diff"] == 0.0 for r in rows)  # columns are independent: the same arithmetic per column
    assert sum(r["chosen"] for r in rows) == 1


def test_the_chain_at_other_projection_blocks_agrees():
    rows = main(["--chain", "2", "--batch", "2", "--heads", "2", "--head-dim", "32", "--hidden", "64",
                 "--splits", "1", "2", "--proj-blocks", "8:32:4"])
    assert [(r["block"], r["splits"]) for r in rows] == [(None, 1), (None, 2), ("8:32:4", 1), ("8:32:4", 2)]
    assert all(r["max_diff"] == 0.0 for r in rows)
    assert all(r["block_diff"] < 5e-2 for r in rows)  # another K step: the products summed in another order
