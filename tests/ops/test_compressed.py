"""DeepSeek-V4 compressed attention references against per-element loops written from their docstrings.

``compress_pool``: per entry, per channel, a softmax over the window's slots (and, with ``overlap``, the
previous window's first-half channels). ``compressed_attention``: per query, per head, a softmax over the
window keys and the admitted entries with ``exp(sink_h)`` added to the denominator only.
"""
from __future__ import annotations

import math

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.ops import call, registered

RTOL, ATOL = 1e-5, 1e-6  # fp32 math compared with float64 loops


def assert_close(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=ATOL)


def test_registered():
    assert {"compress_pool", "compressed_attention"} <= set(registered())


# ---------------------------------------------------------------- compress_pool

def softmax_pool(slots):
    """[(value, logit)] -> Σ softmax(logit) · value; an empty list pools to 0."""
    if not slots:
        return 0.0
    top = max(z for _, z in slots)
    w = [math.exp(z - top) for _, z in slots]
    return sum(wi * c for wi, (c, _) in zip(w, slots)) / sum(w)


def loop_pool(kv, gate, bias, overlap, prev_kv=None, prev_gate=None):
    """e_w[ch] = Σ_j softmax_j(z + B) c over window w's slots; with overlap, slots 0..m-1 are window w-1's
    first-half channel ch, slots m..2m-1 window w's second-half channel d+ch (window -1: no slots)."""
    kv, gate, bias = kv.tolist(), gate.tolist(), bias.tolist()
    m, W = len(bias), len(bias[0])
    n = len(kv) // m
    d = W // 2 if overlap else W
    out = torch.zeros(n, d, dtype=torch.float64)
    for w in range(n):
        for ch in range(d):
            slots = []
            if overlap:
                for j in range(m):
                    if w > 0:
                        slots.append((kv[(w - 1) * m + j][ch], gate[(w - 1) * m + j][ch] + bias[j][ch]))
                    elif prev_kv is not None:
                        slots.append((float(prev_kv[j, ch]), float(prev_gate[j, ch]) + bias[j][ch]))
                for j in range(m):
                    slots.append((kv[w * m + j][d + ch], gate[w * m + j][d + ch] + bias[j][d + ch]))
            else:
                for j in range(m):
                    slots.append((kv[w * m + j][ch], gate[w * m + j][ch] + bias[j][ch]))
            out[w, ch] = softmax_pool(slots)
    return out


def pool_inputs(n, m, W, seed):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(n * m, W, generator=g)
    gate = 2 * torch.randn(n * m, W, generator=g)  # spread the gates so the softmax is far from uniform
    bias = torch.randn(m, W, generator=g)
    prev_kv, prev_gate = torch.randn(m, W, generator=g), 2 * torch.randn(m, W, generator=g)
    return kv, gate, bias, prev_kv, prev_gate


POOL_CASES = [  # (n windows, m, W)
    (3, 4, 12),
    (1, 4, 8),
    (2, 5, 7),
    (4, 1, 6),
    (5, 3, 10),
]


@pytest.mark.parametrize("n,m,W", POOL_CASES, ids=[f"n{n}-m{m}-W{W}" for n, m, W in POOL_CASES])
def test_pool_matches_loop(n, m, W):
    kv, gate, bias, _, _ = pool_inputs(n, m, W, seed=n * 31 + m * 7 + W)
    out = call("compress_pool", kv, gate, bias)
    assert_close(out, loop_pool(kv, gate, bias, False))


@pytest.mark.parametrize("with_prev", [False, True], ids=["first-window", "prev-window"])
@pytest.mark.parametrize("n,m,W", [(3, 4, 16), (1, 4, 8), (4, 3, 10), (2, 1, 6)],
                         ids=["n3-m4-W16", "n1-m4-W8", "n4-m3-W10", "n2-m1-W6"])
def test_overlap_pool_matches_loop(n, m, W, with_prev):
    kv, gate, bias, prev_kv, prev_gate = pool_inputs(n, m, W, seed=n * 13 + m * 5 + W)
    if not with_prev:
        prev_kv = prev_gate = None
    out = call("compress_pool", kv, gate, bias, True, prev_kv, prev_gate)
    assert out.shape == (n, W // 2)
    assert_close(out, loop_pool(kv, gate, bias, True, prev_kv, prev_gate))


def test_overlap_first_window_ignores_missing_window():
    """Without a previous window, entry 0 pools only its own second halves: the same as a plain pool of
    those channels; entries after it do not depend on what window w0-1 would have held."""
    n, m, W = 3, 4, 8
    kv, gate, bias, prev_kv, prev_gate = pool_inputs(n, m, W, seed=5)
    first = call("compress_pool", kv, gate, bias, True)
    plain = call("compress_pool", kv[:m, W // 2:], gate[:m, W // 2:], bias[:, W // 2:])
    torch.testing.assert_close(first[0], plain[0], rtol=RTOL, atol=ATOL)
    with_prev = call("compress_pool", kv, gate, bias, True, prev_kv, prev_gate)
    torch.testing.assert_close(first[1:], with_prev[1:], rtol=0, atol=0)
    assert not torch.allclose(first[0], with_prev[0])


def test_pool_properties():
    """One token per window returns the token's row; equal gates give the window mean."""
    kv, gate, bias, _, _ = pool_inputs(5, 1, 6, seed=2)
    torch.testing.assert_close(call("compress_pool", kv, gate, bias), kv, rtol=RTOL, atol=ATOL)
    kv, gate, _, _, _ = pool_inputs(3, 4, 6, seed=3)
    flat = torch.zeros(4, 6)
    torch.testing.assert_close(call("compress_pool", kv, torch.zeros_like(gate), flat), kv.view(3, 4, 6).mean(1),
                               rtol=RTOL, atol=ATOL)


def test_pool_keeps_dtype_and_rejects_partial_windows():
    kv, gate, bias, _, _ = pool_inputs(2, 4, 8, seed=4)
    out = call("compress_pool", kv.bfloat16(), gate.bfloat16(), bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 8)
    with pytest.raises(ValueError, match="compress_pool"):
        call("compress_pool", kv[:7], gate[:7], bias)
    with pytest.raises(ValueError, match="compress_pool"):
        call("compress_pool", kv, gate[:, :6], bias)


# ---------------------------------------------------------------- compressed_attention

def loop_compressed_attention(q, kv, kv_start, entries, entry_mask, q_pos, scale, sinks, window):
    """Per query t and head h: keys = window rows with q_pos - window < s <= q_pos, then the entries
    entry_mask admits; o = Σ exp(l_i) k_i / (Σ exp(l_i) + exp(sink_h)); no key at all gives 0."""
    Tq, H, D = q.shape
    out = torch.zeros(Tq, H, D, dtype=torch.float64)
    for t in range(Tq):
        p = int(q_pos[t])
        keys = [kv[i].tolist() for i in range(kv.shape[0]) if p - window < kv_start + i <= p]
        keys += [entries[c].tolist() for c in range(entries.shape[0]) if entry_mask[t, c]]
        for h in range(H):
            qh = q[t, h].tolist()
            logits = [scale * sum(a * b for a, b in zip(qh, k)) for k in keys]
            sink = None if sinks is None else float(sinks[h])
            top = max(logits + ([sink] if sink is not None else []), default=0.0)
            e = [math.exp(lg - top) for lg in logits]
            denom = sum(e) + (math.exp(sink - top) if sink is not None else 0.0)
            for dd in range(D):
                out[t, h, dd] = sum(ei * k[dd] for ei, k in zip(e, keys)) / denom if keys else 0.0
    return out


def attention_inputs(Tq, H, D, L, C, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, H, D, generator=g)
    kv = torch.randn(L, D, generator=g)
    entries = torch.randn(C, D, generator=g)
    sinks = torch.randn(H, generator=g) + 1.0  # around the size of the logits, so the sink term matters
    mask = torch.rand(Tq, C, generator=g) < 0.6
    return q, kv, entries, sinks, mask


ATTN_CASES = [  # (Tq, H, D, L, C, window, kv_start)
    (6, 4, 8, 9, 5, 4, 6),
    (1, 2, 16, 3, 2, 8, 0),
    (5, 3, 12, 12, 7, 5, 20),
    (4, 1, 8, 6, 0, 3, 2),
]


@pytest.mark.parametrize("with_sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("Tq,H,D,L,C,window,kv_start", ATTN_CASES,
                         ids=[f"T{t}-H{h}-D{d}-L{l}-C{c}-W{w}-S{s}" for t, h, d, l, c, w, s in ATTN_CASES])
def test_compressed_attention_matches_loop(Tq, H, D, L, C, window, kv_start, with_sinks):
    q, kv, entries, sinks, mask = attention_inputs(Tq, H, D, L, C, seed=Tq * 100 + L * 10 + C)
    if not with_sinks:
        sinks = None
    # the newest Tq window rows are the queries; the first query also sees no entry
    q_pos = torch.arange(kv_start + L - Tq, kv_start + L)
    mask[0] = False
    scale = D**-0.5
    out = call("compressed_attention", q, kv, kv_start, entries, mask, q_pos, scale, sinks, window)
    ref = loop_compressed_attention(q, kv, kv_start, entries, mask, q_pos, scale, sinks, window)
    assert_close(out, ref)


def test_query_without_keys_reads_zero():
    """A query whose window holds no row (its position precedes the rows) and whose mask admits no entry
    gets 0, with or without sinks; the other queries are unaffected."""
    q, kv, entries, sinks, mask = attention_inputs(3, 2, 8, 4, 3, seed=9)
    kv_start, window = 10, 4
    q_pos = torch.tensor([5, 12, 13])  # query 0 sits before every window row
    mask[0] = False
    mask[1:] = True
    for s in (None, sinks):
        out = call("compressed_attention", q, kv, kv_start, entries, mask, q_pos, 8**-0.5, s, window)
        assert torch.equal(out[0], torch.zeros(2, 8))
        assert_close(out, loop_compressed_attention(q, kv, kv_start, entries, mask, q_pos, 8**-0.5, s, window))


def test_sink_only_in_denominator():
    """With a single admitted key, o = k · e^l / (e^l + e^sink): the sink scales the output down and adds
    no value of its own."""
    q, kv, entries, _, _ = attention_inputs(1, 2, 8, 1, 1, seed=11)
    mask = torch.zeros(1, 1, dtype=torch.bool)
    sinks = torch.tensor([0.0, 2.0])
    q_pos = torch.tensor([0])
    out = call("compressed_attention", q, kv, 0, entries, mask, q_pos, 0.5, sinks, 1)
    for h in range(2):
        lg = 0.5 * float(q[0, h] @ kv[0])
        share = 1.0 / (1.0 + math.exp(float(sinks[h]) - lg))
        torch.testing.assert_close(out[0, h], kv[0] * share, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------- decode: every sequence at once

def test_rows_form_equals_one_sequence_at_a_time():
    """``compressed_attention_rows`` (decode, padded) per row equals ``compressed_attention`` of that sequence."""
    g = torch.Generator().manual_seed(11)
    B, H, D, L = 5, 4, 16, 12
    q = torch.randn(B, H, D, generator=g)
    keys = torch.randn(B, L, D, generator=g)
    sinks = torch.randn(H, generator=g)
    n_window = [1, 4, 7, 3, 0]  # window rows of each sequence, then its entries; the rest is padding
    n_entries = [0, 3, 5, 0, 2]
    mask = torch.zeros(B, L, dtype=torch.bool)
    for b in range(B):
        mask[b, : n_window[b] + n_entries[b]] = True
    mask[2, n_window[2] + 1] = False  # an entry the indexer did not choose
    out = call("compressed_attention_rows", q, keys, mask, 0.3, sinks)
    for b in range(B):
        w, c = n_window[b], n_entries[b]
        pos = torch.tensor([20])
        entry_mask = mask[b, w:w + c][None]
        ref = call("compressed_attention", q[b:b + 1], keys[b, :w], 20 - w + 1, keys[b, w:w + c], entry_mask, pos,
                   0.3, sinks, 128)
        assert_close(out[b:b + 1], ref.double())


def test_indexer_rows_form_equals_one_sequence_at_a_time():
    g = torch.Generator().manual_seed(12)
    B, Hi, Di, S, topk = 4, 16, 8, 10, 3
    q, w = torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g)
    k = torch.randn(B, S, Di, generator=g)
    counts = [0, 2, 3, 10]
    valid = torch.arange(S)[None] < torch.tensor(counts)[:, None]
    idx = call("indexer_topk_rows", q, w, k, valid, topk)
    assert idx.shape == (B, topk)
    for b, n in enumerate(counts):
        ref = call("indexer_topk", q[b:b + 1], w[b:b + 1], k[b, :max(n, 1)], torch.tensor([n - 1]), topk)
        assert set(idx[b].tolist()) == set(ref[0].tolist()), b
        assert sorted(i for i in idx[b].tolist() if i >= 0) == sorted(range(n)) or n > topk
