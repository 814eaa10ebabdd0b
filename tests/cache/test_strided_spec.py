"""Strided paged rows (one row per m tokens, DeepSeek-V4's compressed entries): block geometry, bytes per
token, allocation, and where ``ForwardBatch.entry_slots`` puts each entry."""
from __future__ import annotations

import math

import pytest
import torch

from dayzero.cache.quant import QuantPagedPool
from dayzero.cache.spec import PagedSpec, StateSpec, allocate, parts
from dayzero.engine.batch import ForwardBatch

BS = 16
STRIDES = [1, 4, 128]


def strided_spec() -> PagedSpec:
    """A token row, a value-like entry row every 4 tokens, and a key-like entry row every 128 tokens."""
    return PagedSpec(
        rows={"tok": ((2, 32), torch.bfloat16), "csa": ((64,), torch.bfloat16), "hca": ((48,), torch.float32)},
        roles={"hca": "key"},
        strides={"csa": 4, "hca": 128},
    )


# ---------------------------------------------------------------- PagedSpec

def test_rows_per_block():
    spec = strided_spec()
    assert [spec.rows_per_block(n, BS) for n in ("tok", "csa", "hca")] == [16, 4, 1]
    # ceil(block_size / m): a stride that does not divide the block still rounds up
    odd = PagedSpec({"e": ((8,), torch.float32)}, strides={"e": 5})
    assert [odd.rows_per_block("e", bs) for bs in (16, 15, 5, 4, 1)] == [4, 3, 1, 1, 1]


def test_only_keeps_role_and_stride():
    spec = strided_spec()
    hca = spec.only("hca")
    assert hca.rows == {"hca": ((48,), torch.float32)} and hca.roles == {"hca": "key"} and hca.strides == {"hca": 128}
    tok = spec.only("tok")
    assert tok.rows == {"tok": ((2, 32), torch.bfloat16)} and tok.roles == {} and tok.strides == {}
    assert tok.rows_per_block("tok", BS) == BS and hca.rows_per_block("hca", BS) == 1


def plain_bytes(shape, itemsize, stride, bs=BS):
    """A plain row of stride m: ceil(bs / m) rows of prod(shape) elements per block of bs tokens."""
    return math.prod(shape) * itemsize * math.ceil(bs / stride) / bs


def quant_bytes(shape, key, stride, bs=BS):
    """An fp8 block: one byte per element of each of its ceil(bs / m) rows, plus bf16 scales: one per
    channel per block (key-like) or one per row per leading index (value-like)."""
    rows = math.ceil(bs / stride)
    n = math.prod(shape)
    scales = n if key else rows * math.prod(shape[:-1])
    return (rows * n + 2 * scales) / bs


@pytest.mark.parametrize("stride", STRIDES)
@pytest.mark.parametrize("shape,dtype", [((64,), torch.bfloat16), ((2, 48), torch.float32)],
                         ids=["64-bf16", "2x48-fp32"])
def test_bytes_per_token_one_row(stride, shape, dtype):
    for role in ("value", "key"):
        spec = PagedSpec({"r": (shape, dtype)}, roles={"r": role}, strides={"r": stride})
        assert spec.bytes_per_token("auto", BS) == plain_bytes(shape, dtype.itemsize, stride)
        assert spec.bytes_per_token("float32", BS) == plain_bytes(shape, 4, stride)
        assert spec.bytes_per_token("fp8", BS) == quant_bytes(shape, role == "key", stride)


def test_bytes_per_token_numbers():
    """A 64-wide bf16 row (128 bytes) costs 128, 32 and 8 bytes per token at strides 1, 4 and 128: a block of
    16 tokens holds at least one row, so m = 128 costs as much as m = 16."""
    got = [PagedSpec({"r": ((64,), torch.bfloat16)}, strides={"r": m}).bytes_per_token("auto", BS) for m in STRIDES]
    assert got == [128, 32, 8] and all(isinstance(v, int) for v in got)
    # fp8, value-like: 64 bytes + one bf16 scale per row; key-like: 64 bytes per row + 64 bf16 scales per block
    assert [PagedSpec({"r": ((64,), torch.bfloat16)}, strides={"r": m}).bytes_per_token("fp8", BS) for m in STRIDES] \
        == [66, 16.5, 4.125]
    assert [PagedSpec({"r": ((64,), torch.bfloat16)}, {"r": "key"}, {"r": m}).bytes_per_token("fp8", BS)
            for m in STRIDES] == [72, 24, 12]


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_bytes_per_token_sums_rows_and_matches_storage(kv):
    spec = strided_spec()
    if kv == "auto":
        ref = plain_bytes((2, 32), 2, 1) + plain_bytes((64,), 2, 4) + plain_bytes((48,), 4, 128)
    else:
        ref = quant_bytes((2, 32), False, 1) + quant_bytes((64,), False, 4) + quant_bytes((48,), True, 128)
    assert spec.bytes_per_token(kv, BS) == pytest.approx(ref, rel=1e-12)
    # the bytes one allocated block holds, per token of the block
    stored = 0
    for t in allocate(spec, 1, BS, "cpu", kv).values():
        stored += t.nbytes
    assert stored / BS == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("kv", ["auto", "float32", "fp8"])
def test_allocate_strided_shapes(kv):
    spec = strided_spec()
    pools = allocate(spec, 3, BS, "cpu", kv)
    assert set(pools) == {"tok", "csa", "hca"}
    expect = {"tok": (3, 16, 2, 32), "csa": (3, 4, 64), "hca": (3, 1, 48)}
    for name, shape in expect.items():
        pool = pools[name]
        if kv == "fp8":
            assert isinstance(pool, QuantPagedPool) and tuple(pool.data.shape) == shape
            assert pool.data.dtype == torch.float8_e4m3fn and pool.block_size == shape[1]
            key = name == "hca"
            assert pool.per_channel == key
            assert tuple(pool.scale.shape) == ((3, *shape[2:]) if key else shape[:-1])
        else:
            assert tuple(pool.shape) == shape and not pool.any()
            assert pool.dtype == (torch.float32 if kv == "float32" else spec.rows[name][1])


def test_allocate_state_and_parts():
    state = StateSpec({"raw": ((8, 6), torch.float32), "gate": ((8, 6), torch.bfloat16)})
    out = allocate(state, 5, BS, "cpu")
    assert {n: (tuple(t.shape), t.dtype) for n, t in out.items()} == {"raw": ((5, 8, 6), torch.float32),
                                                                      "gate": ((5, 8, 6), torch.bfloat16)}
    paged = strided_spec()
    assert parts(paged) == (paged,)
    assert parts(state) == (state,)
    assert parts((paged, state)) == (paged, state)


# ---------------------------------------------------------------- ForwardBatch.entry_slots

def make_batch(seq_lens: list[int], tables: list[list[int]]) -> ForwardBatch:
    """Two sequences decoding one token each (only the block tables matter for entry_slots)."""
    B = len(seq_lens)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(B, width, dtype=torch.int64)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t)
    return ForwardBatch(
        input_ids=torch.zeros(B, dtype=torch.int64),
        positions=torch.tensor([n - 1 for n in seq_lens]),
        query_start=list(range(B + 1)),
        seq_start=[n - 1 for n in seq_lens],
        seq_lens=seq_lens,
        slot_mapping=torch.zeros(B, dtype=torch.int64),
        block_tables=block_tables,
        state_slots=torch.arange(B),
        logits_indices=torch.arange(B),
        block_size=BS,
    )


def distinct_tables(seq_lens: list[int], seed: int) -> list[list[int]]:
    """Block ids 1.. shuffled and dealt out, so no two blocks of any sequence share an id."""
    need = [math.ceil(n / BS) for n in seq_lens]
    ids = (torch.randperm(sum(need) + 5, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    out, at = [], 0
    for k in need:
        out.append(ids[at:at + k])
        at += k
    return out


@pytest.mark.parametrize("stride", [4, 128, 5])
def test_entry_slots_lie_in_their_blocks(stride):
    seq_lens = [stride * 11 + 3, stride * 6]  # a partial window at the end of the first sequence
    tables = distinct_tables(seq_lens, seed=stride)
    batch = make_batch(seq_lens, tables)
    per_block = math.ceil(BS / stride)
    seen = set()
    for b, n in enumerate(seq_lens):
        N = n // stride
        slots = batch.entry_slots(b, stride, torch.arange(N)).tolist()
        assert len(set(slots)) == N
        for w, slot in enumerate(slots):
            block = tables[b][(w * stride) // BS]  # the block holding token w*m
            assert block * per_block <= slot < (block + 1) * per_block, (w, slot, block)
        assert seen.isdisjoint(slots)  # no two sequences share a row
        seen.update(slots)


@pytest.mark.parametrize("stride", [4, 128])
def test_entry_slots_fill_blocks_in_order(stride):
    """When m divides or exceeds the block, entries of one block take its rows 0, 1, ... in turn; a subset of
    entries (one decode step's) gets the same slots as in the full list."""
    seq_lens = [stride * 9]
    tables = distinct_tables(seq_lens, seed=1)
    batch = make_batch(seq_lens, tables)
    per_block = max(1, BS // stride)
    slots = batch.entry_slots(0, stride, torch.arange(9))
    for w in range(9):
        block = tables[0][(w * stride) // BS]
        assert int(slots[w]) == block * per_block + w % per_block
    sub = torch.tensor([7, 2, 5])
    assert torch.equal(batch.entry_slots(0, stride, sub), slots[sub])


def test_entry_slots_stride_one_are_token_slots():
    seq_lens = [37, 20]
    tables = distinct_tables(seq_lens, seed=2)
    batch = make_batch(seq_lens, tables)
    for b, n in enumerate(seq_lens):
        expect = [tables[b][p // BS] * BS + p % BS for p in range(n)]
        assert batch.entry_slots(b, 1, torch.arange(n)).tolist() == expect
