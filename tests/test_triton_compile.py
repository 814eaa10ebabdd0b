"""The session-end sm90 compile check (tests/triton_compile.py): a kernel the interpreter runs but the compiler
refuses is reported with its specialisation and the compiler's message; a sound one compiles."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tests import triton_compile  # noqa: E402


@triton.jit
def _branch_tiles_kernel(x_ptr, y_ptr, flag, A: tl.constexpr, B: tl.constexpr, SAME_NAME: tl.constexpr):
    # y[:A] = 2 x[:A] where flag, else y[:B] = 3 x[:B]; with SAME_NAME both branches assign ``v`` with tiles of
    # A and B elements: the interpreter runs it, the compiler refuses the merge at the runtime ``if``
    if SAME_NAME:
        if flag != 0:
            v = tl.load(x_ptr + tl.arange(0, A)) * 2
            tl.store(y_ptr + tl.arange(0, A), v)
        else:
            v = tl.load(x_ptr + tl.arange(0, B)) * 3
            tl.store(y_ptr + tl.arange(0, B), v)
    else:  # no name assigned in either branch
        if flag != 0:
            tl.store(y_ptr + tl.arange(0, A), tl.load(x_ptr + tl.arange(0, A)) * 2)
        else:
            tl.store(y_ptr + tl.arange(0, B), tl.load(x_ptr + tl.arange(0, B)) * 3)


def _specs(same_name: bool) -> list[dict]:
    x, y = torch.arange(16, dtype=torch.float32), torch.zeros(16)
    args, kwargs = (x, y, 1), dict(A=16, B=8, SAME_NAME=same_name, num_warps=4)
    specs = {}
    triton_compile.record(_branch_tiles_kernel.fn, list(_branch_tiles_kernel.arg_names), args, kwargs, into=specs)
    if triton_compile.INTERPRETED:  # the interpreter runs either form and gets the same rows (not recorded for
        with triton_compile.unrecorded():  # the session's own check, which the refused form would fail)
            _branch_tiles_kernel[(1,)](*args, **kwargs)
        assert all(s["name"] != "_branch_tiles_kernel" for s in triton_compile.recorded())
        assert torch.equal(y, torch.arange(16, dtype=torch.float32) * 2)
    return list(specs.values())


@pytest.mark.parametrize("same_name", [True, False])
def test_a_kernel_the_compiler_refuses_fails_the_check_with_its_message(same_name):
    specs = _specs(same_name)
    assert [s["constants"] for s in specs] == [dict(A=16, B=8, SAME_NAME=same_name)]
    assert specs[0]["signature"] == dict(x_ptr="*fp32", y_ptr="*fp32", flag="i32", A="constexpr", B="constexpr",
                                         SAME_NAME="constexpr")
    rc, report = triton_compile.check(specs)
    assert "1 specialisations of 1 kernels" in report, report
    if same_name:
        assert rc == 1 and "FAILED tests.test_triton_compile._branch_tiles_kernel(A=16, B=8" in report, report
        assert "Mismatched type for v" in report, report
    else:
        assert rc == 0 and "0 failed" in report, report
