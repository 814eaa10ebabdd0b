"""benchmarks/moe_decode.py on the CPU (Triton's interpreter, shapes divided by 32): both chains run and agree,
as do the block output's variants (``--dual``), and a step with more pairs than the direct kernels take is skipped
with the reason."""
from __future__ import annotations

import pytest

from benchmarks.moe_decode import main, moe_shapes, print_table
from dayzero.ops import triton_support

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")


def test_dayzero_smalls_moe_shapes():
    m = moe_shapes("configs/dayzero-small.json")
    assert (m["D"], m["L"], m["I"], m["E"], m["layers"]) == (2048, 512, 512, 64, 23)
    assert m["route"](None) == (8, "sigmoid", None, 8, 4, True, 2.5)


def test_both_chains_run_and_agree(capsys):
    out = main(["--layers", "2", "--rows", "1", "2", "5"])
    assert [r["rows"] for r in out["rows"]] == [1, 2]
    assert all(r["max_diff"] < 5e-2 for r in out["rows"])
    assert "5 rows: 40 (token, expert) pairs" in capsys.readouterr().out


def test_the_output_launch_variants_run_and_agree():
    out = main(["--layers", "2", "--rows", "1", "--dual"])
    (r,) = out["dual"]
    assert "output apart" in r["variants"] and any(v.endswith("early") for v in r["variants"])
    assert r["max_diff"] < 5e-2


def test_the_early_routing_variants_run_and_agree():
    out = main(["--layers", "2", "--rows", "1", "--early", "--up-widths", "8", "--down-widths", "2",
                "--up-blocks", "8:16:8"])
    (r,) = out["early"]
    assert r["variants"] == ["late", "early, up only", "early", "early, up 8 columns", "early, down 2 columns",
                             "early, up 8x16, 8 warps"]
    assert r["max_diff"] == 0.0  # the same kernels' arithmetic, routed before or after the wait


def test_the_table_gives_each_mode_against_apart(capsys):
    print_table([{"rows": 1, "us": {"apart": 230.0, "inside, 4 warps": 200.0, "inside, 2 warps": None},
                  "max_diff": 0.0}], 23)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["1", "apart", "230.0", "10.00", "1.00x"]
    assert lines[2].split() == ["1", "inside,", "4", "warps", "200.0", "8.70", "1.15x"]
    assert lines[3].split()[-3:] == ["-", "-", "-"]
