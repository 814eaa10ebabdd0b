"""The greedy sampling kernels (a pass per slice of each row, then a merge) against the sampler's torch ops (the reference): first maxima under ties,
rows with NaN or ±inf, odd vocabularies across the kernel's blocks, bf16 and fp32 logits; and the sampler's fast
path giving what its general path gives. On the CPU the kernel runs through Triton's interpreter."""
from __future__ import annotations

import math

import pytest
import torch

from dayzero.engine.sampler import Sampler
from dayzero.engine.sampling_params import SamplingParams
from dayzero.ops import triton_support
from dayzero.ops.sampling import kernels as K
from dayzero.ops.sampling.reference import greedy_sample

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def agree(logits):
    ids, lp = K.greedy_sample_triton(logits)
    want_ids, want_lp = greedy_sample(logits)
    assert ids.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    nan = want_lp.isnan()
    assert torch.equal(lp.isnan(), nan)
    assert torch.allclose(lp[~nan], want_lp[~nan], rtol=1e-5, atol=1e-5)
    return ids, lp


@pytest.mark.parametrize("V", [7, K.BLOCK, K.BLOCK + 1, 3 * K.BLOCK - 5, 2 * K.SLICE + 1], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_random_rows(V, dtype):
    g = torch.Generator(DEV).manual_seed(V)
    agree((4 * torch.randn(5, V, generator=g, device=DEV)).to(dtype))


def test_ties_take_the_first_maximum_across_lanes_and_blocks():
    V = 2 * K.BLOCK + 40
    x = torch.zeros(4, V, device=DEV)
    x[0, [5, 900, K.BLOCK + 5]] = 3.0  # lanes 5 and 900 of block 0, lane 5 of block 1
    x[1, [K.BLOCK + 3, 2 * K.BLOCK + 1, K.BLOCK + 700]] = 2.0  # the first in block 1, at a lane past a later one
    x[2, [2 * K.BLOCK + 39, 2 * K.BLOCK + 10]] = 1.0  # both in the ragged last block
    ids, _ = agree(x)  # row 3: all equal
    assert ids.tolist() == [5, K.BLOCK + 3, 2 * K.BLOCK + 10, 0]


def test_ties_take_the_first_maximum_across_slices():
    V = 2 * K.SLICE + 7
    x = torch.zeros(3, V, device=DEV)
    x[0, [K.SLICE + 9, 2 * K.SLICE + 1]] = 4.0  # slices 1 and 2: the first is in slice 1
    x[1, [2 * K.SLICE + 6, K.SLICE - 1, 3]] = 5.0  # the last of slice 0 and the first lane, the latter first
    x[2, 2 * K.SLICE + 6] = 1.0  # the vocabulary's last logit, alone in the ragged slice's last lanes
    ids, lp = agree(x)
    assert ids.tolist() == [K.SLICE + 9, 3, 2 * K.SLICE + 6]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's inf - inf
def test_rows_with_nan_or_inf_fail_alone():
    x = torch.randn(5, 300, device=DEV)
    x[0, 17], x[1, 299], x[2, 0] = float("nan"), float("inf"), float("-inf")
    ids, lp = agree(x)
    y = torch.randn(3, 2 * K.SLICE + 5, device=DEV)
    y[0, K.SLICE + 2] = float("nan")  # a failing slice that is not the row's first
    ids2, _ = agree(y)
    assert ids2[0] == -1 and (ids2[1:] >= 0).all()
    assert ids[:3].tolist() == [-1, -1, -1] and lp[:3].isnan().all()
    assert (ids[3:] >= 0).all() and (lp[3:] <= 0).all()


def test_one_hot_row_has_logprob_zero_and_a_flat_row_minus_log_v():
    x = torch.full((2, 500), -30.0, device=DEV)
    x[0, 123] = 60.0
    x[1] = 0.5
    ids, lp = agree(x)
    assert ids.tolist() == [123, 0]
    assert abs(lp[0].item()) < 1e-6 and abs(lp[1].item() + math.log(500)) < 1e-5


def test_the_host_rows_hold_each_rows_id_and_log_probability():
    g = torch.Generator(DEV).manual_seed(9)
    logits = torch.randn(4, K.SLICE + 77, generator=g, device=DEV)
    logits[2, 5] = float("nan")
    rows = torch.full((4, 2), 7.0, dtype=torch.float64, device=DEV)
    ids, lp = K.greedy_sample_triton(logits, rows)
    want = torch.stack([ids.double(), lp.double()], 1)
    assert torch.equal(rows.nan_to_num(3.0), want.nan_to_num(3.0)) and rows[2, 0] == -1
    ref_rows = torch.zeros_like(rows)
    greedy_sample(logits, ref_rows)
    assert torch.equal(ref_rows[:, 0], rows[:, 0])
    assert "fp64 [B, 2]" in K.refusal(logits, rows[:3])


def test_no_rows_and_refusals():
    assert K.greedy_sample_triton(torch.zeros(0, 10, device=DEV))[0].shape == (0,)
    assert K.refusal(torch.zeros(2, 10, device=DEV)) is None
    assert "contiguous" in K.refusal(torch.zeros(10, 2, device=DEV).t())
    assert "vocabularies past" in K.refusal(torch.empty(1, K.MAX_SLICES * K.SLICE + 1, device=DEV))
    assert K.refusal(torch.empty(1, K.MAX_SLICES * K.SLICE, device=DEV)) is None
    assert "float64" in K.refusal(torch.zeros(2, 10, dtype=torch.float64, device=DEV))


def test_sampler_fast_path_equals_its_general_path(monkeypatch):
    """Greedy rows without penalties or alternatives take ``greedy_sample``; forcing the general path (a row asking
    for one alternative, then dropped) gives the same ids and log-probabilities."""
    import dayzero.engine.sampler as S

    taken = []
    real = S.greedy_fast
    monkeypatch.setattr(S, "greedy_fast", lambda logits: taken.append(1) or real(logits))
    g = torch.Generator(DEV).manual_seed(0)
    logits = torch.randn(6, 1000, generator=g, device=DEV).to(torch.bfloat16)
    logits[4, 3] = float("nan")
    greedy = [SamplingParams(temperature=0.0, max_tokens=4)] * 6
    fast = Sampler()(logits, greedy, [None] * 6, [[1, 2]] * 6)
    assert taken == [1]
    general = Sampler()(logits, [SamplingParams(temperature=0.0, max_tokens=4, logprobs=1)] * 6, [None] * 6)
    assert torch.equal(fast.token_ids, general.token_ids)
    assert torch.allclose(fast.logprobs, general.logprobs, equal_nan=True, rtol=1e-5, atol=1e-5)
    assert fast.rows is not None  # the host copy takes the rows the kernel wrote, not a concatenation
    got, want = fast.to_host(), general.to_host()
    assert got.token_ids == want.token_ids and got.top is None
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), equal_nan=True, atol=1e-5)
    Sampler()(logits, [SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.3)] * 6, [None] * 6,
              [[1, 2]] * 6)
    assert taken == [1]  # penalised rows keep the general path
