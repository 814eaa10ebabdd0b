"""benchmarks/head_product.py on the CPU (Triton's interpreter, small shapes): the kernel and the einsum agree at
every row count."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from benchmarks.head_product import main  # noqa: E402


def test_both_products_agree_at_every_row_count():
    rows = main(["--heads", "2", "--nope", "16", "--v", "16", "--rank", "32", "--rows", "1", "3", "8"])
    assert [r["rows"] for r in rows] == [1, 3, 8]
    assert all(r["max_diff"] < 1e-4 for r in rows)  # fp32 on the CPU: the same products, summed in another order
