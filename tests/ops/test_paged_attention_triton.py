"""The paged varlen GQA/MQA attention kernel (``triton_paged.py``) against the per-sequence reference
``paged_attention`` (``paged.py``): on the CPU through Triton's interpreter at tiny shapes (tests/conftest.py sets
TRITON_INTERPRET=1 without a GPU), and on a GPU at realistic shapes, captured in a CUDA graph. Pools hold NaN
wherever no sequence owns a row (the tail of each sequence's last block included), so a kernel that reads a row
it must not read, even with weight 0, fails."""
from __future__ import annotations

import pytest
import torch

import dayzero.ops  # noqa: F401  (registers the ops)
from dayzero.cache.quant import QuantPagedPool
from dayzero.engine.batch import ForwardBatch
from dayzero.ops import triton_support
from dayzero.ops.attention import paged as attn_ref
from tests.ops.paged_batch import capture, make_batch, make_pool, num_blocks_of, on_device

pytest.importorskip("triton")
from dayzero.ops.attention import triton_paged  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# name: (cached tokens per sequence, new tokens per sequence, block size, padding rows). Lengths (start + new)
# that end exactly at a block boundary (4, 8, 16) and one past it (5, 9, 17), a fresh prompt, a chunk continuing
# a sequence, single-token sequences (position 0).
STEPS = {
    "prefill": ([0, 0, 0], [13, 8, 1], 4, 0),
    "decode": ([3, 16, 8, 0, 4], [1, 1, 1, 1, 1], 4, 0),
    "mixed": ([0, 9, 3, 15], [7, 1, 20, 1], 4, 0),
    "decode-pad": ([15, 16, 2], [1, 1, 1], 16, 2),
    "mixed-bs16": ([0, 16, 5], [17, 1, 27], 16, 0),
}
# (H, Hkv, Dqk, Dv): G = 1, 2, 4; MQA (G = 3: not a power of two, and G = 8); head dims not powers of two
HEADS = {"G1": (2, 2, 16, 16), "G2": (4, 2, 24, 24), "G4-Dv": (8, 2, 40, 24), "MQA3": (3, 1, 24, 40),
         "MQA8": (8, 1, 16, 16)}


def close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    assert torch.isfinite(a).all()
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item()
    rel = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    assert err <= tol * (1 + b.abs().max().item()) and rel <= tol, (err, rel)


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype).to(DEV)


def step(name: str, seed: int = 0) -> ForwardBatch:
    starts, news, bs, pad = STEPS[name]
    return make_batch(starts, news, bs, seed=seed, pad_rows=pad)


def inputs(batch: ForwardBatch, heads, dtype, seed: int, num_blocks: int | None = None):
    """q [T, H, Dqk] and the key / value pools (NaN where no sequence owns a row) on DEV."""
    H, Hkv, Dqk, Dv = heads
    nb = num_blocks or num_blocks_of(batch)
    k = make_pool(batch, (Hkv, Dqk), nb, seed=seed, dtype=dtype).to(DEV)
    v = make_pool(batch, (Hkv, Dv), nb, seed=seed + 1, dtype=dtype).to(DEV)
    return randn(batch.num_tokens, H, Dqk, seed=seed + 2, dtype=dtype), k, v


def kernel(q, k, v, batch, scale, sinks=None, window=None, **kw):
    return triton_paged.paged_attention(q, k, v, batch.block_tables, batch.cu_seqlens, batch.positions,
                                        batch.block_size, scale, sinks, window, **kw)


def past_windows(batch: ForwardBatch, pools, window: int):
    """The pools with NaN in each sequence's rows before the window of its earliest query row of the step (no
    query reads them: what an engine that recycles blocks sliding out of the window may leave there)."""
    pools = [p.clone() for p in pools]
    for b in range(batch.num_seqs):
        first = int(batch.positions[batch.rows(b)].min()) if batch.rows(b).stop > batch.rows(b).start else 0
        stale = batch.key_slots(b)[: max(0, first - window + 1)]
        for p in pools:
            p.view(-1, *p.shape[2:])[stale] = float("nan")
    return pools


def check(name, heads, dtype, sinks=False, window=None, seed=0, **kw):
    batch = step(name, seed)
    q, k, v = inputs(batch, heads, dtype, seed + 1)
    s = randn(heads[0], seed=seed + 5) if sinks else None
    dev = on_device(batch, DEV)
    scale = heads[2] ** -0.5
    kk, vv = (k, v) if window is None else past_windows(dev, (k, v), window)  # the reference reads them all
    out = kernel(q, kk, vv, dev, scale, s, window, **kw)
    close(out, attn_ref.paged_attention(q, k, v, dev, scale, s, window), TOL[dtype])
    return out


# ---------------------------------------------------------------- tiny shapes (the interpreter on the CPU)

# fp32 on every layout; bf16 on two of them (G = 2, and MQA with G = 3 and Dv > Dqk)
LAYOUTS = [(h, "fp32") for h in HEADS] + [("G2", "bf16"), ("MQA3", "bf16")]


@pytest.mark.parametrize("heads,dtype", LAYOUTS, ids=[f"{h}-{d}" for h, d in LAYOUTS])
@pytest.mark.parametrize("name", list(STEPS))
def test_equals_the_reference(name, heads, dtype):
    check(name, HEADS[heads], DTYPES[dtype], seed=len(name))


# windows of one key, shorter than a block, across blocks, past the context; fp32 everywhere, bf16 on a few
WINDOWS = [(n, w, s, "fp32") for n in ("mixed", "decode-pad", "mixed-bs16") for w in (1, 3, 6, 1000)
           for s in (False, True)] + [(n, w, s, "bf16") for n in ("mixed", "mixed-bs16") for w in (3, 1000)
                                      for s in (False, True)]


@pytest.mark.parametrize("name,window,sinks,dtype", WINDOWS,
                         ids=[f"{n}-w{w}-{'sinks-' if s else ''}{d}" for n, w, s, d in WINDOWS])
def test_window_and_sinks(name, window, sinks, dtype):
    check(name, HEADS["G4-Dv"], DTYPES[dtype], sinks, window, seed=window)


@pytest.mark.parametrize("tiles", [(1, 16), (2, 16), (4, 32), (32, 16)], ids=["M1", "M2", "M4-N32", "M32"])
@pytest.mark.parametrize("name", ["prefill", "mixed", "mixed-bs16"])
def test_tile_sizes(name, tiles):
    """Many tiles per sequence (their numbering, the gaps between sequences' tiles) and one tile for all."""
    block_m, block_n = tiles
    for heads in ("G1", "MQA8"):
        check(name, HEADS[heads], torch.float32, True, 5 if block_m == 2 else None, seed=block_m,
              block_m=block_m, block_n=block_n)


def test_sequences_without_rows_and_rows_without_keys():
    """A sequence that brings no row this step (its tiles are empty programs), and window 0: no query reads a
    key, so every output is 0 with or without sinks (they join the denominator only)."""
    batch = make_batch([4, 6, 0, 2], [5, 0, 3, 1], 4, seed=3)
    heads = HEADS["G2"]
    q, k, v = inputs(batch, heads, torch.float32, 4)
    dev = on_device(batch, DEV)
    s = randn(heads[0], seed=5)
    for block_m in (None, 1, 2):
        out = kernel(q, k, v, dev, 0.2, s, block_m=block_m, block_n=16)
        close(out, attn_ref.paged_attention(q, k, v, dev, 0.2, s), TOL[torch.float32])
    for sinks in (None, s):
        assert torch.equal(kernel(q, k, v, dev, 0.2, sinks, 0), torch.zeros_like(q[..., :heads[3]]))


def test_output_layout_and_strided_inputs():
    """q as a strided view (a slice of a fused qkv projection), the pools as views of one kv pool."""
    batch = step("mixed", 7)
    H, Hkv, D = 4, 2, 24
    nb = num_blocks_of(batch)
    kv = make_pool(batch, (2, Hkv, D), nb, seed=8).to(DEV)  # [nb, bs, 2, Hkv, D]: k and v interleaved
    qkv = randn(batch.num_tokens, H + 2 * Hkv, D, seed=9)
    q, k, v = qkv[:, :H], kv[:, :, 0], kv[:, :, 1]
    dev = on_device(batch, DEV)
    out = kernel(q, k, v, dev, 0.3)
    assert out.shape == (batch.num_tokens, H, D) and out.is_contiguous()
    close(out, attn_ref.paged_attention(q, k.contiguous(), v.contiguous(), dev, 0.3), TOL[torch.float32])


def test_tile_config_depends_on_shapes_only():
    assert triton_paged.tile_config(64, 64, 4, 128, 128) == (4, 4, 64, 4)  # decode: M = 16
    assert triton_paged.tile_config(4096, 1, 4, 128, 128) == (32, 4, 64, 8)  # prefill: M = 128
    assert triton_paged.tile_config(4096, 2, 1, 256, 256) == (64, 1, 32, 4)  # wide heads: M = 64
    assert triton_paged.tile_config(8, 8, 128, 64, 64) == (1, 128, 64, 8)  # MQA, 128 heads: one row a tile
    assert triton_paged.tile_config(30, 4, 3, 24, 40, block_m=3, block_n=20) == (4, 4, 32, 4)


def quantised(plain: torch.Tensor, kind: str, per_channel: bool, out_dtype) -> QuantPagedPool:
    """``plain``'s rows written into a quantised pool as the cache writes them (keys: scales per channel per
    block; values: per token row); rows no sequence owns get NaN codes (fp8) or 127, and per-token scales inf."""
    nb, bs, *row = plain.shape
    pool = QuantPagedPool(nb, bs, tuple(row), kind, per_channel, plain.device, out_dtype)
    flat = plain.reshape(nb * bs, *row).float()
    live = flat.flatten(1).isfinite().all(-1)
    pool.write(live.nonzero().squeeze(-1), flat[live])
    dead = (~live).view(nb, bs)
    pool.data.view(torch.uint8)[dead] = 0x7F  # NaN in e4m3, 127 in int8
    if not per_channel:
        pool.scale[dead] = float("inf")
    return pool


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", ["mixed", "decode-pad", "mixed-bs16"])
def test_quantised_pools_equal_the_reference(name, dtype, kind):
    """FP8 / INT8 KV caches: keys dequantised with their blocks' channel scales as they are loaded, values' row
    scales folded into the softmax weights; against the reference over the same pools (which dequantises the rows
    it gathers), with a window and sinks too."""
    batch = step(name, 3)
    heads = HEADS["G2"]
    q, k, v = inputs(batch, heads, torch.float32, 7)
    kq, vq = quantised(k, kind, True, dtype), quantised(v, kind, False, dtype)
    q = q.to(dtype)
    dev = on_device(batch, DEV)
    if dtype == torch.float32 and DEV == "cuda":
        assert "fp32 model" in triton_paged.refusal(q, kq, vq)
        return
    assert triton_paged.refusal(q, kq, vq) is None
    for sinks, window in ((None, None), (randn(heads[0], seed=8), 3)):
        out = kernel(q, kq, vq, dev, heads[2] ** -0.5, sinks, window)
        close(out, attn_ref.paged_attention(q, kq, vq, dev, heads[2] ** -0.5, sinks, window), TOL[dtype])


def test_refusal_names_its_reason(monkeypatch):
    batch = step("decode")
    q, k, v = inputs(batch, HEADS["G2"], torch.bfloat16, 10)
    assert triton_paged.refusal(q, k, v) is None
    assert triton_paged.refusal(q, k, v, torch.zeros(4, device=DEV), 8) is None
    quant = QuantPagedPool(4, 4, (2, 24), "fp8", True, DEV, torch.bfloat16)
    assert "quantised" in triton_paged.refusal(q, quant, v)
    assert "quantised" in triton_paged.refusal(q, k, quant)
    assert "[num_blocks, block_size, Hkv, D]" in triton_paged.refusal(q, k.flatten(2), v)
    assert "multiple" in triton_paged.refusal(q[:, :3], k, v)
    wide_k, wide_v = k.new_zeros(2, 4, 2, 384), v.new_zeros(2, 4, 2, 8)
    assert "head dims" in triton_paged.refusal(q.new_zeros(1, 4, 384), wide_k, wide_v)
    assert "do not match" in triton_paged.refusal(q[..., :16], k, v)
    assert "dtypes differ" in triton_paged.refusal(q.float(), k, v)
    assert "sinks" in triton_paged.refusal(q, k, v, torch.zeros(3, device=DEV))
    assert "dtype" in triton_paged.refusal(q.int(), k.int(), v.int())
    if DEV == "cuda":
        assert "fp32" in triton_paged.refusal(q.float(), k.float(), v.float())
    monkeypatch.setattr(triton_support, "HAS_TRITON", False)
    assert triton_paged.refusal(q, k, v) == "triton is not installed"


# ---------------------------------------------------------------- on a GPU, at realistic shapes

def big_inputs(batch, dtype=torch.bfloat16, seed=30, heads=(32, 8, 128, 128), num_blocks=None):
    return inputs(on_device(batch, "cpu"), heads, dtype, seed, num_blocks)


@gpu
@pytest.mark.filterwarnings("ignore:Synchronization debug mode")
@pytest.mark.parametrize("window_sinks", [(None, False), (128, True), (4096, False)], ids=["", "w128-sinks", "w4096"])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_gpu_at_realistic_shapes(kind, bs, window_sinks):
    window, sinks = window_sinks
    starts, news = {"prefill": ([0, 0, 1000], [2048, 511, 513]),
                    "decode": ([8191, 2047, 5000, 0, 63, 64], [1] * 6),
                    "mixed": ([0, 3000, 1000, 4095, 17], [1024, 1, 300, 1, 1])}[kind]
    batch = make_batch(starts, news, bs, seed=31, pad_rows=2 if kind == "decode" else 0)
    q, k, v = big_inputs(batch)
    s = randn(32, seed=32) if sinks else None
    dev = on_device(batch, DEV)
    assert triton_paged.refusal(q, k, v, s, window) is None
    with torch.cuda.device(DEV):
        torch.cuda.set_sync_debug_mode("error")  # a host read of a device value raises
        try:
            out = kernel(q, k, v, dev, 128**-0.5, s, window)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    close(out, attn_ref.paged_attention(q, k, v, dev, 128**-0.5, s, window), TOL[torch.bfloat16])


@gpu
@pytest.mark.parametrize("heads", [(16, 4, 192, 128), (8, 2, 40, 24), (8, 1, 64, 128)],
                         ids=["192-128", "40-24", "64-128"])
def test_gpu_head_dims_that_differ(heads):
    """Dv != Dqk at prefill tile sizes (M = 64 and 128: the wgmma path), wide heads (192 pads to 256)."""
    batch = make_batch([0, 700, 5], [600, 1, 90], 16, seed=33)
    q, k, v = big_inputs(batch, heads=heads)
    s = randn(heads[0], seed=34)
    dev = on_device(batch, DEV)
    for window in (None, 100):
        out = kernel(q, k, v, dev, 0.1, s, window)
        close(out, attn_ref.paged_attention(q, k, v, dev, 0.1, s, window), TOL[torch.bfloat16])


@gpu
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_gpu_replays_in_a_cuda_graph(kind):
    """Captured once on one step, replayed on others of the same shapes (T rows, B sequences, table width):
    other positions, block tables, cu_seqlens and pool contents; the same as the eager call each time."""
    bs, heads = 16, (32, 8, 128, 128)
    if kind == "decode":  # a padded decode step: 3 real rows and a padding row
        steps = [make_batch(st, [1, 1, 1], bs, seed=40 + i, pad_rows=1)
                 for i, st in enumerate(([8191, 100, 4000], [3000, 8000, 2047], [0, 15, 16]))]
    else:  # 1 + 300 + 211 = 9 + 2 + 501 = 512 rows in 3 sequences
        steps = [make_batch(st, nw, bs, seed=40 + i) for i, (st, nw) in enumerate(
            (([2000, 0, 5000], [1, 300, 211]), ([0, 7000, 3], [9, 2, 501]), ([4096, 4095, 0], [256, 255, 1])))]
    nb = max(num_blocks_of(b) for b in steps)
    width = max(b.block_tables.shape[1] for b in steps)
    T, B = steps[0].num_tokens, steps[0].num_seqs
    assert all((b.num_tokens, b.num_seqs) == (T, B) for b in steps)
    pools = [big_inputs(b, seed=41 + i, heads=heads, num_blocks=nb) for i, b in enumerate(steps)]
    q, k, v = (t.clone() for t in pools[0])
    tables = torch.zeros(B, width, dtype=torch.int64, device=DEV)
    cu = torch.zeros(B + 1, dtype=torch.int64, device=DEV)
    positions = torch.zeros(T, dtype=torch.int64, device=DEV)
    sinks = randn(heads[0], seed=42)

    def call():
        return triton_paged.paged_attention(q, k, v, tables, cu, positions, bs, 0.09, sinks, 4096)

    def load(i):
        batch = steps[i]
        tables.zero_()[:, : batch.block_tables.shape[1]] = batch.block_tables.to(DEV)
        cu.copy_(batch.cu_seqlens)
        positions.copy_(batch.positions)
        for dst, src in zip((q, k, v), pools[i]):
            dst.copy_(src)

    load(0)
    graph, out = capture(call)
    for i in (1, 0, 2):
        load(i)
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        assert torch.equal(replayed, call())
        close(replayed, attn_ref.paged_attention(q, k, v, on_device(steps[i], DEV), 0.09, sinks, 4096),
              TOL[torch.bfloat16])
