"""benchmarks/weight_preload.py on the CPU (Triton's interpreter, shapes divided by 64): the chain of a decode step's
skinny products runs in every mode, its weights read after or (first K step) before the wait, with outputs equal
bit for bit (the script stops otherwise)."""
from __future__ import annotations

import pytest

from benchmarks.weight_preload import main
from dayzero.ops import triton_support

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")


def test_the_chain_is_equal_in_every_mode(capsys):
    out = main(["--rows", "1"])
    assert out["launches"] == 118 and out["weight_bytes"] > 0
    assert "equal bit for bit in every mode" in capsys.readouterr().out
