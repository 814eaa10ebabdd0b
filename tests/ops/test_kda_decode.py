"""``kda_decode``: the one-launch Triton kernel (Triton's interpreter on the CPU) gives the composition of the ops
apart (conv, the gates' up-projections, the delta rule) its output, its output gate, and the same windows and
states in the pools: continuing and fresh sequences, padding rows of a captured step, the safe gate's lower bound
and the plain one, the up-projections in the kernel and as a GEMM first, a head's state whole in one program and
split over 2 and 4 by value columns (q's and k's windows then written by the last program of the head), a
program's columns in one chunk or several; slots the step does not own keep their bytes."""
from __future__ import annotations

import pytest
import torch

from dayzero.ops import triton_support
from dayzero.ops.kda import decode_kernels as D, step
from dayzero.ops.static import mark_static
from tests.ops.paged_batch import capture, make_batch, on_device

pytestmark = pytest.mark.skipif(not triton_support.HAS_TRITON, reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS = 16


def _case(H, K, W, dtype, starts, pad_rows=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = H * K
    batch = on_device(make_batch(starts, [1] * len(starts), 4, seed=seed, num_slots=SLOTS - 1, pad_rows=pad_rows),
                      DEV)
    B = len(starts) + pad_rows
    proj = torch.randn(B, 3 * P + 2 * K + H + 5, generator=g)[:, 2:-3].to(dtype).to(DEV)  # a view of a wider GEMM
    conv_weight = (0.5 * torch.randn(3 * P, 1, W, generator=g)).to(dtype).to(DEV)
    conv_pool = torch.randn(SLOTS, 3 * P, W - 1, generator=g).to(dtype).to(DEV)
    gate_up = mark_static((torch.randn(2, P, K, generator=g) / K**0.5).to(dtype).to(DEV))  # read before the wait
    A_log = torch.randn(H, generator=g).to(DEV)
    dt_bias = torch.randn(P, generator=g).to(DEV)
    state = torch.randn(SLOTS, H, K, K, generator=g).to(DEV)
    state[0] = float("nan")  # the null slot: nothing may read it
    return proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch


def _run(fn, case, lower):
    proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch = case
    pool, st = conv_pool.clone(), state.clone()
    o, og = fn(proj, conv_weight, pool, gate_up, A_log, dt_bias, lower, proj.shape[1] ** -0.5, st, batch)
    return o, og, pool, st


@pytest.mark.parametrize("H,K,W", [(2, 16, 4), (3, 32, 2), (1, 64, 5), (2, 128, 3)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("lower", [None, -5.0])
@pytest.mark.parametrize("up", [True, False], ids=["up_in_kernel", "up_as_gemm"])
def test_the_kernel_gives_the_composition(H, K, W, dtype, lower, up, monkeypatch):
    _check(H, K, W, dtype, lower, up, monkeypatch)
    if up:  # the gates' weights read after the wait, as for a weight that is not the model's
        monkeypatch.setenv("DAYZERO_WEIGHT_PRELOAD", "0")
        _check(H, K, W, dtype, lower, up, monkeypatch)
    assert D._splits(4, H, K) == {16: 1, 32: 2, 64: 4, 128: 8}[K]  # heads split by columns of 16 or more


@pytest.mark.parametrize("H,K,W,splits,cols", [(2, 16, 4, 1, 8), (3, 32, 2, 1, 8), (1, 64, 5, 2, 16),
                                               (2, 128, 3, 1, 32), (1, 128, 4, 2, 16)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("up", [True, False], ids=["up_in_kernel", "up_as_gemm"])
def test_columns_in_chunks_give_the_composition(H, K, W, splits, cols, dtype, up, monkeypatch):
    """A program's value columns through the delta rule several chunks in turn, the next chunk's state and
    windows read before the current one's update: whole heads and heads split by columns."""
    monkeypatch.setattr(D, "CHUNK_COLS", cols)
    monkeypatch.setattr(D, "_splits", lambda B, H, K: splits)
    assert K // splits // cols >= 2
    _check(H, K, W, dtype, -5.0, up, monkeypatch)


def _check(H, K, W, dtype, lower, up, monkeypatch):
    if not up:
        monkeypatch.setattr(D, "UP_MAX_ROWS", 0)
    case = _case(H, K, W, dtype, starts=[5, 0, 9, 2], pad_rows=1 if up else 0)
    assert D.refusal(*case[:6], lower, 1.0, *case[6:]) is None
    want = _run(step.kda_decode, case, lower)
    got = _run(D.kda_decode, case, lower)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: a rounded input an ulp apart, then through the state
    batch = case[-1]
    real = batch.state_slots[batch.state_slots != 0]
    for name, w, o in zip(("output", "output gate"), want[:2], got[:2]):
        torch.testing.assert_close(o.float()[:len(real)], w.float()[:len(real)], rtol=tol, atol=tol, msg=name)
    torch.testing.assert_close(got[2][real].float(), want[2][real].float(), rtol=tol, atol=tol, msg="windows")
    torch.testing.assert_close(got[3][real], want[3][real], rtol=tol, atol=tol, msg="states")
    others = torch.ones(SLOTS, dtype=torch.bool, device=DEV)
    others[batch.state_slots] = False  # neither the sequences' slots nor the null slot
    for before, after in ((case[2], got[2]), (case[6], got[3])):
        torch.testing.assert_close(after[others], before[others], rtol=0, atol=0, equal_nan=True)
    assert not torch.equal(got[3][real], case[6][real])
    # whole periods between launches: the next launch's or replay's last arrival is told apart
    assert all(int((c % D.COUNT_PERIOD).sum()) == 0 for c in D._COUNTERS.values())


def test_a_fresh_sequence_reads_neither_its_window_nor_its_state():
    """A fresh sequence's slot may hold anything (NaN here): the kernel reads it as zero, like the composition."""
    case = _case(2, 16, 4, torch.float32, starts=[0, 3])
    proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch = case
    fresh_slot = int(batch.state_slots[0])
    state[fresh_slot] = float("nan")
    conv_pool[fresh_slot] = float("nan")
    o, og, pool, st = _run(D.kda_decode, case, -5.0)
    assert torch.isfinite(o).all() and torch.isfinite(st[fresh_slot]).all() and torch.isfinite(pool[fresh_slot]).all()
    conv_pool[fresh_slot], state[fresh_slot] = 0.0, 0.0
    want = _run(step.kda_decode, case, -5.0)
    torch.testing.assert_close(o, want[0], rtol=1e-5, atol=1e-5)


def test_refusals_leave_the_composition_to_run():
    case = _case(2, 16, 4, torch.float32, starts=[3, 4])
    proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch = case
    args = lambda **kw: {**dict(proj=proj, conv_weight=conv_weight, conv_pool=conv_pool, gate_up=gate_up,  # noqa: E731
                                A_log=A_log, dt_bias=dt_bias, lower_bound=None, scale=1.0, state_pool=state,
                                batch=batch), **kw}
    prefill = on_device(make_batch([0, 2], [3, 1], 4), DEV)
    assert "prefill" in D.refusal(**args(batch=prefill))
    assert "fp32" in D.refusal(**args(state_pool=state.bfloat16()))
    assert "power of two" in D.refusal(**args(state_pool=torch.zeros(SLOTS, 2, 24, 24, device=DEV),
                                              proj=proj.new_zeros(2, 3 * 48 + 48 + 2)))
    assert "3P + 2K + H" in D.refusal(**args(proj=proj[:, :-1]))
    assert "[2, P, K]" in D.refusal(**args(gate_up=gate_up.transpose(1, 2)))
    assert "taps" in D.refusal(**args(conv_pool=torch.zeros(SLOTS, 96, 9, device=DEV)))
    with pytest.raises(ValueError, match="3P \\+ 2K \\+ H"):
        step.kda_decode(**args(proj=proj[:, :-1]))


def test_every_sequence_of_a_full_pool_splits_its_heads_with_counters_of_its_own():
    case = _case(3, 128, 4, torch.float32, starts=list(range(SLOTS - 1)))  # every slot taken: 45 counters in use
    assert D._splits(SLOTS - 1, 3, 128) == 8
    want, got = _run(step.kda_decode, case, -5.0), _run(D.kda_decode, case, -5.0)
    real = case[-1].state_slots
    for w, o in zip(want[:2], got[:2]):
        torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
    for w, o in zip(want[2:], got[2:]):  # windows, states
        torch.testing.assert_close(o[real], w[real], rtol=1e-5, atol=1e-5)
    assert all(int((c % D.COUNT_PERIOD).sum()) == 0 for c in D._COUNTERS.values())


def test_the_last_arrival_is_told_apart_whatever_split_ran_before(monkeypatch):
    """Launches of one layer split its heads 2, 8, 1 and 4 ways in turn (steps of other sizes): each time the
    head's last program writes the q and k windows, as the composition leaves them, and the counters end on whole
    periods."""
    case = _case(2, 128, 4, torch.float32, starts=[5, 0, 9])
    proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch = case
    pools = {"kernel": (conv_pool.clone(), state.clone()), "composition": (conv_pool.clone(), state.clone())}
    real = batch.state_slots[batch.state_slots != 0]
    for nv in (2, 8, 1, 4):
        monkeypatch.setattr(D, "_splits", lambda B, H, K, nv=nv: nv)
        outs = {}
        for name, fn in (("kernel", D.kda_decode), ("composition", step.kda_decode)):
            pool, st = pools[name]
            outs[name] = fn(proj, conv_weight, pool, gate_up, A_log, dt_bias, -5.0, 0.1, st, batch)[0]
        torch.testing.assert_close(outs["kernel"], outs["composition"], rtol=1e-5, atol=1e-5)
        for got, want in zip(pools["kernel"], pools["composition"]):  # windows, states
            torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
        assert all(int((c % D.COUNT_PERIOD).sum()) == 0 for c in D._COUNTERS.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replays_of_a_captured_step_equal_eager_steps():
    """Three replays of one captured launch (heads split over 8 programs: the counters must be back at zero after
    each) leave the windows and states that three eager launches leave."""
    case = _case(2, 128, 4, torch.bfloat16, starts=[5, 7, 9])
    proj, conv_weight, conv_pool, gate_up, A_log, dt_bias, state, batch = case
    assert D._splits(3, 2, 128) == 8
    args = lambda pool, st: (proj, conv_weight, pool, gate_up, A_log, dt_bias, -5.0, 0.1, st, batch)  # noqa: E731
    eager_pool, eager_state = conv_pool.clone(), state.clone()
    for _ in range(3):
        want = D.kda_decode(*args(eager_pool, eager_state))
    pool, st = conv_pool.clone(), state.clone()
    assert D.refusal(*args(pool, st)) is None  # the layer's counters made eagerly, before the capture
    saved = pool.clone(), st.clone()
    graph, out = capture(lambda: D.kda_decode(*args(pool, st)))
    pool.copy_(saved[0])
    st.copy_(saved[1])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for w, o in zip(want, out):
        torch.testing.assert_close(o, w, rtol=0, atol=0)
    torch.testing.assert_close(pool, eager_pool, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(st, eager_state, rtol=0, atol=0, equal_nan=True)
