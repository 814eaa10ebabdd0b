"""benchmarks/ticket_fusion.py on the CPU (Triton's interpreter, tiny shapes): two launches and one launch of
ticket-ordered items give the same rows, those of an fp32 reference, and leave the counters zero for the next
replay."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.ticket_fusion import VARIANTS, main, parse_block  # noqa: E402


@pytest.mark.parametrize("groups", [1, 2])
def test_one_launch_of_tickets_gives_the_rows_of_two_launches(groups):
    rows = main(["--shapes", "64:32:64", "48:32:48", "--rows", "1", "3", "--layers", "2", "--block", "16:16:8:32",
                 "--groups", str(groups)])
    assert [(r["shape"], r["rows"], r["groups"]) for r in rows] == [
        ("64:32:64", 1, groups), ("64:32:64", 3, groups), ("48:32:48", 1, groups), ("48:32:48", 3, groups)]
    for r in rows:
        assert r["max_diff"] == 0.0  # every item sums the same products in the same order, whoever launches it
        assert r["ref_diff"] < 1e-5  # fp32 on the CPU
        assert (r["linear_diff"] is None) == (groups > 1)  # the engine's kernel computes no block-diagonal W2
        if groups == 1:
            assert r["linear_diff"] < 1e-5
        assert r["counters_zero"]  # the last program zeroed them: a replay starts from ticket 0


def test_a_block_and_a_shape_of_another_form_are_refused():
    assert parse_block("4:1024") == ((4, 1024), (4, 1024))
    for bad in ("4", "4:0", "1:2:3"):
        with pytest.raises(SystemExit, match="--block"):
            parse_block(bad)
    with pytest.raises(SystemExit, match="N2 must equal K"):
        main(["--shapes", "64:32:48", "--layers", "1", "--rows", "1"])
    with pytest.raises(SystemExit, match="whole blocks"):  # 32 / 4 groups is 8 columns of h, not two 16-wide blocks
        main(["--shapes", "64:32:64", "--layers", "1", "--rows", "1", "--block", "16:16", "--groups", "4"])
    assert VARIANTS[0] == "two launches"  # the ratios' baseline
