"""Shared by the end-to-end signal tests: they run the engine as users get it on a CPU."""
from __future__ import annotations

import pytest

from dayzero.ops import triton_support


@pytest.fixture(scope="module", autouse=True)
def users_cpu_path():
    """The CPU path users get: the suite runs Triton's interpreter for its kernel tests, which would, e.g., convert
    every MXFP4 expert through the interpreted kernel at every step."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_support, "INTERPRET", False)
        yield
