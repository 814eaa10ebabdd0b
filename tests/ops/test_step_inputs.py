"""``step_inputs``: the Triton kernel (Triton's interpreter on the CPU) scatters a step's staged values into the
arena and patches an overlapped step's input ids exactly as the reference's ``index_copy_`` / gather / clamp do,
its patch reading rows and sources the same launch scattered; bad operands are refused with the reason."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.step import kernels as K, reference as R

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(total: int, n_patch: int, seed: int = 0):
    """An arena whose input ids are words 0..99, the patch's rows and sources words 100.. and 200..; ``total``
    values staged for other words, plus the patch's rows (distinct ids) and sources (samples 0..8)."""
    g = torch.Generator().manual_seed(seed)
    arena = torch.randint(-50, 50, (3000,), generator=g)
    values = torch.cat((torch.randint(0, 99, (total,), generator=g), torch.randperm(100, generator=g)[:n_patch],
                        torch.randint(0, 9, (n_patch,), generator=g)))
    places = torch.cat((torch.randperm(2000, generator=g)[:total] + 1000, torch.arange(100, 100 + n_patch),
                        torch.arange(200, 200 + n_patch)))
    stage = torch.cat((values, places, torch.full((7,), 123)))  # a stage longer than what is sent
    tokens = torch.randint(-1, 1000, (9,), generator=g)
    tokens[3] = -1  # a sample whose logits were not finite
    return arena.to(DEV), stage.to(DEV), values.shape[0], (n_patch, tokens.to(DEV))


@pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("total,n_patch", [(5, 0), (20, 3), (1500, 9)], ids=str)
def test_the_kernel_scatters_and_patches_as_the_reference_does(total, n_patch):
    arena, stage, m, (n, tokens) = _case(total, n_patch)
    want, got = arena.clone(), arena.clone()
    patch = lambda a: (a[:100], a[100:100 + n], a[200:200 + n], tokens) if n else None  # noqa: E731
    assert K.refusal(got, stage, m, patch(got)) is None
    R.step_inputs(want, stage, m, patch(want))
    K.step_inputs(got, stage, m, patch(got))
    assert torch.equal(got, want)
    assert not torch.equal(got, arena)
    if n:  # the patched rows hold the samples, -1 read as token 0
        rows, src = got[100:100 + n].long(), got[200:200 + n].long()
        assert torch.equal(got[:100][rows], tokens[src].clamp_min(0))


def test_refusals_name_the_reason():
    arena = torch.zeros(10, dtype=torch.int64, device=DEV)
    if DEV == "cpu" and not triton_support.INTERPRET:
        assert K.refusal(arena, arena, 0) is not None
        return
    assert K.refusal(arena, arena, 0) is None
    assert "int64" in K.refusal(arena, arena.int(), 0)
    assert "int64" in K.refusal(arena, arena, 0, (arena[:4], arena[4:6], arena[6:8], arena[:3].view(3, 1)))
