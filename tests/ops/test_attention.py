"""The attention reference against a straightforward full-matrix softmax written here."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops import call, registered
from dayzero.ops.attention import reference as attn_ref
from dayzero.ops.attention.reference import attention, indices_to_mask

# Tolerances per dtype: (max-abs, relative). bf16 inputs are compared with the fp32 math on the
# same (already rounded) inputs, so only the output rounding (8 bits of mantissa) remains.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}


def naive_attention(q, k, v, q_pos, scale, key_mask=None, sinks=None, window=None):
    """Full [H, Tq, S] scores, masked_fill, softmax (a sink is an extra column that is dropped)."""
    q, k, v = q.double(), k.double(), v.double()
    Tq, H, _ = q.shape
    S, Hkv, _ = k.shape
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    allowed = torch.zeros(Tq, S, dtype=torch.bool)
    for t in range(Tq):
        for s in range(S):
            ok = s <= q_pos[t] and (window is None or s > q_pos[t] - window)
            allowed[t, s] = ok and (key_mask is None or bool(key_mask[t, s]))
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(H, 1, 1).expand(H, Tq, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :S]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows with nothing allowed
    return torch.einsum("hts,shd->thd", probs, v)


def check_close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    out, ref = out.double(), ref.double()
    max_abs = (out - ref).abs().max().item()
    rel = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    assert max_abs <= atol and rel <= rtol, f"max-abs {max_abs:.3g} (tol {atol}), rel {rel:.3g} (tol {rtol})"


# (S, Tq, H, Hkv, Dqk, Dv): Tq < S is a chunk continuing a sequence, q_pos = S-Tq .. S-1
SHAPES = [
    (37, 37, 4, 2, 16, 16),
    (1, 1, 2, 1, 8, 8),
    (64, 1, 8, 2, 24, 16),
    (50, 13, 6, 3, 16, 20),
    (33, 33, 5, 5, 12, 12),
    (29, 29, 8, 1, 20, 8),
]
SHAPE_IDS = [f"S{s}-T{t}-H{h}-Hkv{hk}-D{d}-Dv{dv}" for s, t, h, hk, d, dv in SHAPES]
VARIANTS = ["causal", "window", "sinks", "key_mask", "window-sinks-key_mask"]


def make_inputs(S, Tq, H, Hkv, Dqk, Dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, H, Dqk, generator=g)
    k = torch.randn(S, Hkv, Dqk, generator=g)
    v = torch.randn(S, Hkv, Dv, generator=g)
    q_pos = torch.arange(S - Tq, S, dtype=torch.int64)
    return q.to(dtype), k.to(dtype), v.to(dtype), q_pos, g


def variant_kwargs(variant, S, Tq, H, g):
    kw = {}
    if "window" in variant:
        kw["window"] = 7
    if "sinks" in variant:
        kw["sinks"] = torch.randn(H, generator=g) * 2
    if "key_mask" in variant:
        kw["key_mask"] = torch.rand(Tq, S, generator=g) < 0.6
    return kw


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_attention_matches_naive(shape, variant):
    S, Tq, H, Hkv, Dqk, Dv = shape
    q, k, v, q_pos, g = make_inputs(*shape)
    kw = variant_kwargs(variant, S, Tq, H, g)
    scale = Dqk**-0.5
    out = attention(q, k, v, q_pos, scale, **kw)
    assert out.shape == (Tq, H, Dv) and out.dtype == q.dtype
    check_close(out, naive_attention(q, k, v, q_pos, scale, **kw), torch.float32)


@pytest.mark.parametrize("variant", ["causal", "window-sinks-key_mask"])
@pytest.mark.parametrize("shape", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_attention_bf16(shape, variant):
    S, Tq, H, Hkv, Dqk, Dv = shape
    q, k, v, q_pos, g = make_inputs(*shape, dtype=torch.bfloat16)
    kw = variant_kwargs(variant, S, Tq, H, g)
    out = attention(q, k, v, q_pos, Dqk**-0.5, **kw)
    assert out.dtype == torch.bfloat16
    check_close(out, naive_attention(q, k, v, q_pos, Dqk**-0.5, **kw), torch.bfloat16)


def test_sinks_and_window_change_the_result():
    # Guards the comparisons above against options that are silently ignored.
    q, k, v, q_pos, g = make_inputs(40, 40, 4, 2, 16, 16)
    base = attention(q, k, v, q_pos, 0.25)
    assert (attention(q, k, v, q_pos, 0.25, sinks=torch.zeros(4)) - base).abs().max() > 1e-3
    assert (attention(q, k, v, q_pos, 0.25, window=5) - base).abs().max() > 1e-3


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_query_without_allowed_keys_is_zero(with_sinks):
    S, Tq, H = 20, 6, 4
    q, k, v, q_pos, g = make_inputs(S, Tq, H, 2, 8, 8)
    key_mask = torch.rand(Tq, S, generator=g) < 0.5
    key_mask[2] = False  # query 2 reads nothing
    key_mask[4, : q_pos[4] + 1] = False  # query 4 only allows future keys, which causality removes
    key_mask[4, q_pos[4] + 1 :] = True
    sinks = torch.randn(H, generator=g) if with_sinks else None
    out = attention(q, k, v, q_pos, 0.3, key_mask=key_mask, sinks=sinks)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.equal(out[4], torch.zeros_like(out[4]))
    assert out[[0, 1, 3, 5]].abs().amax(dim=(1, 2)).min() > 0
    check_close(out, naive_attention(q, k, v, q_pos, 0.3, key_mask=key_mask, sinks=sinks), torch.float32)


def test_negative_position_reads_nothing():
    q, k, v, _, _ = make_inputs(5, 2, 2, 1, 8, 8)
    out = attention(q, k, v, torch.tensor([-1, 0]), 0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().max() > 0


@pytest.mark.parametrize("q_block", [1, 7, 256], ids=lambda b: f"block{b}")
@pytest.mark.parametrize("window", [None, 100], ids=["causal", "window100"])
def test_blocked_equals_unblocked(q_block, window):
    S, Tq, H, Hkv = 600, 597, 4, 2
    q, k, v, q_pos, g = make_inputs(S, Tq, H, Hkv, 8, 8)
    sinks = torch.randn(H, generator=g)
    full = attention(q, k, v, q_pos, 0.35, sinks=sinks, window=window, q_block=Tq)
    blocked = attention(q, k, v, q_pos, 0.35, sinks=sinks, window=window, q_block=q_block)
    torch.testing.assert_close(blocked, full, atol=1e-6, rtol=1e-6)


def test_default_blocking_follows_the_budget(monkeypatch):
    assert attn_ref.q_block_rows(128, 1 << 20) == 1  # long context: one row per block
    assert attn_ref.q_block_rows(4, 100) == attn_ref.MAX_Q_BLOCK
    S, Tq = 300, 300
    q, k, v, q_pos, _ = make_inputs(S, Tq, 4, 2, 8, 8)
    full = attention(q, k, v, q_pos, 0.35, q_block=Tq)
    monkeypatch.setattr(attn_ref, "SCORE_BUDGET", 4 * S * 5)  # 5 rows per block
    assert attn_ref.q_block_rows(4, S) == 5
    torch.testing.assert_close(attention(q, k, v, q_pos, 0.35), full, atol=1e-6, rtol=1e-6)


def test_indices_to_mask():
    idx = torch.tensor([[3, 0, -1], [-1, -1, -1], [4, 1, 2]])
    mask = indices_to_mask(idx, 5)
    expect = torch.tensor([
        [True, False, False, True, False],
        [False, False, False, False, False],
        [False, True, True, False, True],
    ])
    assert mask.dtype == torch.bool and torch.equal(mask, expect)


def test_registered_and_callable_through_registry():
    ops = registered()
    for name in ("attention", "mla_naive", "mla_absorbed", "indexer_topk", "indexer_scores"):
        assert name in ops and "reference" in ops[name].impls
    q, k, v, q_pos, _ = make_inputs(9, 3, 2, 1, 8, 8)
    torch.testing.assert_close(call("attention", q, k, v, q_pos, 0.3), attention(q, k, v, q_pos, 0.3))
