"""The fresh-slot zeroing kernel of KDA decode steps: the slots of fresh rows become zero, every other slot (the
null slot too) keeps its bytes, at state sizes across the kernel's blocks. Triton's interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.kda import slot_kernels as S

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("shape", [(2, 3, 5), (S.BLOCK + 7,), (2, 64, 64)], ids=str)
def test_only_fresh_rows_slots_are_zeroed(shape):
    pool = torch.randn(7, *shape, device=DEV)
    before = pool.clone()
    slots = torch.tensor([3, 0, 5, 0, 6], device=DEV)  # rows 1 and 3 use the null slot, not fresh
    fresh = torch.tensor([True, False, True, False, False], device=DEV)
    S.zero_fresh_slots(pool, slots, fresh)
    want = before.clone()
    want[[3, 5]] = 0
    assert torch.equal(pool, want)


def test_no_rows_and_the_refusal():
    pool = torch.randn(3, 4, 4, device=DEV)
    S.zero_fresh_slots(pool, slots=torch.zeros(0, dtype=torch.long, device=DEV),
                       fresh=torch.zeros(0, dtype=torch.bool, device=DEV))
    assert S.refusal(pool) is None
    assert "contiguous" in S.refusal(pool.transpose(1, 2))
