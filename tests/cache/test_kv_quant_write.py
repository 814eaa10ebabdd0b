"""QuantPagedPool.write without host syncs: bit for bit equal to the reference write (the earlier
torch.unique form) on random multi-step workloads, deterministic and finite when padding rows share the
null block's slots, free of syncs on CUDA and replayable from a CUDA graph."""
from __future__ import annotations

import random

import pytest
import torch

from dayzero.cache.quant import SCALE_DTYPE, QuantPagedPool

KINDS = ["fp8", "int8"]
MODES = [False, True]
MODE_IDS = ["per-token", "per-channel"]
ROWS = [(2, 8), (16,)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def reference_write(pool: QuantPagedPool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """The write as it was before it became sync-free (torch.unique sizes its buffers on the host)."""
    rows = rows.float()
    if not pool.per_channel:
        s = pool._scale_of(rows.abs().amax(-1))  # [N, *row[:-1]]
        pool.data.view(-1, *pool.row)[slots] = pool._quant(rows, s[..., None])
        pool.scale.view(-1, *pool.row[:-1])[slots] = s.to(SCALE_DTYPE)
        return
    bs = pool.block_size
    blocks, offs = slots // bs, slots % bs
    ub, inv = torch.unique(blocks, return_inverse=True)  # [U], [N]
    first = torch.full((ub.numel(),), bs, dtype=offs.dtype, device=offs.device).scatter_reduce(0, inv, offs, "amin")
    old = pool.data[ub].float() * pool.scale[ub].float()[:, None]  # [U, bs, *row] dequantised
    keep = torch.arange(bs, device=offs.device)[None, :] < first[:, None]  # rows written before this step
    old = old * keep.view(*keep.shape, *([1] * len(pool.row)))  # a product, not a fill: stale negatives become -0
    old[inv, offs] = rows
    s = pool._scale_of(old.abs().amax(1))  # [U, *row]
    pool.data[ub] = pool._quant(old, s[:, None])
    pool.scale[ub] = s.to(SCALE_DTYPE)


def bits(pool: QuantPagedPool) -> tuple[torch.Tensor, torch.Tensor]:
    """Storage as integers, so -0 and +0 (and every rounding) count as different."""
    return pool.data.view(torch.uint8).cpu(), pool.scale.view(torch.int16).cpu()


def assert_same_bits(a: QuantPagedPool, b: QuantPagedPool) -> None:
    (da, sa), (db, sb) = bits(a), bits(b)
    assert torch.equal(da, db), f"data differs in {(da != db).sum().item()} bytes"
    assert torch.equal(sa, sb), f"scales differ in {(sa != sb).sum().item()} entries"


def twin_pools(kind, per_channel, row, device, num_blocks=10, block_size=4, seed=0):
    """Two pools in the same state, every block holding an earlier owner's (large) rows."""
    a = QuantPagedPool(num_blocks, block_size, row, kind, per_channel, device, torch.float32)
    g = torch.Generator().manual_seed(seed)
    stale = 50 * torch.randn(num_blocks * block_size, *row, generator=g)
    reference_write(a, torch.arange(num_blocks * block_size, device=device), stale.to(device))
    b = QuantPagedPool(num_blocks, block_size, row, kind, per_channel, device, torch.float32)
    b.data.copy_(a.data)
    b.scale.copy_(a.scale)
    return a, b


def workload(num_blocks: int, block_size: int, row: tuple[int, ...], steps: int, seed: int):
    """Steps of (slots, rows) from a few sequences sharing the pool: decode rows and prefill chunks in
    one step, blocks freed and handed to new sequences with their stale contents, block 0 never used.
    Also counts the cases the equality test must cover."""
    out = []
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    free = list(range(1, num_blocks))
    live: list[list] = []  # [block_table, length]
    seen = dict(decode=0, chunk=0, block_start=0, crosses_block=0, reused=0, empty=0)
    used = set()
    for _ in range(steps):
        while len(live) < 3 and len(free) >= 3:
            live.append([[], 0])
        slots = []
        for seq in rng.sample(live, rng.randint(0, len(live))):
            table, length = seq
            n = 1 if rng.random() < 0.5 else rng.randint(1, 2 * block_size + 1)
            if (length + n + block_size - 1) // block_size - len(table) > len(free):
                continue
            seen["decode" if n == 1 else "chunk"] += 1
            for pos in range(length, length + n):
                if pos % block_size == 0:
                    b = free.pop(rng.randrange(len(free)))
                    seen["reused"] += b in used
                    used.add(b)
                    table.append(b)
                    seen["block_start"] += 1
                slots.append(table[pos // block_size] * block_size + pos % block_size)
            seen["crosses_block"] += length // block_size != (length + n - 1) // block_size
            seq[1] = length + n
        for seq in [s for s in live if s[1] > 3 * block_size or rng.random() < 0.1]:
            free.extend(seq[0])  # finished: its blocks keep their rows for the next owner
            live.remove(seq)
        seen["empty"] += not slots
        rows = torch.randn(len(slots), *row, generator=g)
        rows[..., 1] *= 10  # an outlier channel
        rows *= rng.choice([0.1, 1.0, 30.0])  # later rows sometimes raise a block's scale, sometimes not
        out.append((torch.tensor(slots, dtype=torch.long), rows))
    return out, seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("row", ROWS, ids=lambda r: "row" + "x".join(map(str, r)))
@pytest.mark.parametrize("per_channel", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [4, 5], ids=lambda b: f"bs{b}")
def test_write_equals_reference_bit_for_bit(kind, per_channel, row, block_size, device):
    new, ref = twin_pools(kind, per_channel, row, device, block_size=block_size, seed=block_size)
    steps, seen = workload(10, block_size, row, steps=60, seed=block_size)
    assert all(seen.values()), seen
    for slots, rows in steps:
        slots, rows = slots.to(device), rows.to(device)
        new.write(slots, rows)
        reference_write(ref, slots, rows)
        assert_same_bits(new, ref)
    assert torch.equal(new.read(torch.arange(40, device=device)), ref.read(torch.arange(40, device=device)))


@pytest.mark.parametrize("per_channel", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_stale_negatives_after_the_written_rows_keep_their_bits(kind, per_channel):
    """A block reused mid-way: rows after the written ones are zeroed by a product (-0 for negatives),
    which fp8 stores as a different byte than +0."""
    new, ref = twin_pools(kind, per_channel, (1, 8), "cpu", block_size=8)
    ref.data[3] = ref.data[3].float().abs().neg().to(ref.data.dtype)  # every stale row of block 3 negative
    new.data.copy_(ref.data)
    slots, rows = torch.tensor([24, 25, 26]), torch.randn(3, 1, 8)
    new.write(slots, rows)
    reference_write(ref, slots, rows)
    assert_same_bits(new, ref)


def _padded(seed: int, row, block_size: int):
    """Real rows into blocks 1-3 and many padding rows into the null block 0, some at the same slot."""
    g = torch.Generator().manual_seed(seed)
    real = torch.tensor([5, 6, 9, 13, 14, 15])
    pad = torch.randint(0, block_size, (3 * block_size,), generator=g)  # more rows than the block holds
    slots = torch.cat([pad[:4], real[:3], pad[4:], real[3:]])
    rows = 10 * torch.randn(len(slots), *row, generator=g)
    return slots, rows, slots >= block_size


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_padding_rows_in_the_null_block_are_finite_deterministic_and_local(kind, per_channel, device):
    row, bs = (2, 8), 4
    new, ref = twin_pools(kind, per_channel, row, device, num_blocks=6, block_size=bs)
    slots, rows, is_real = _padded(3, row, bs)
    new.write(slots.to(device), rows.to(device))
    reference_write(ref, slots[is_real].to(device), rows[is_real].to(device))
    (dn, sn), (dr, sr) = bits(new), bits(ref)
    assert torch.equal(dn[1:], dr[1:]) and torch.equal(sn[1:], sr[1:]), "padding rows reached another block"
    assert torch.isfinite(new.read(torch.arange(bs, device=device))).all()
    # a slot written several times stores its first row, whatever order the device applies writes in
    firsts = [i for i, s in enumerate(slots.tolist()) if s < bs and s not in slots[:i].tolist()]
    reference_write(ref, slots[firsts].to(device), rows[firsts].to(device))
    assert_same_bits(new, ref)


@needs_cuda
@pytest.mark.parametrize("per_channel", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_write_does_not_sync(kind, per_channel):
    pool, _ = twin_pools(kind, per_channel, (2, 8), "cuda")
    steps = [(s.cuda(), r.cuda()) for s, r in workload(10, 4, (2, 8), steps=20, seed=1)[0]]
    pad, rows, _ = _padded(1, (2, 8), 4)
    steps.append((pad.cuda(), rows.cuda()))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for slots, rows in steps:
            pool.write(slots, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("per_channel", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_graph_replay_equals_eager_write(kind, per_channel):
    """One captured write, replayed on each decode step's slots and rows copied into its static inputs."""
    row, bs, batch = (2, 8), 4, 3
    graphed, eager = twin_pools(kind, per_channel, row, "cuda", num_blocks=13, block_size=bs)
    start = bits(graphed)
    slots = torch.zeros(batch, dtype=torch.long, device="cuda")  # static inputs: padding into block 0
    rows = torch.zeros(batch, *row, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture, then restore the pool
        graphed.write(slots, rows)
    torch.cuda.current_stream().wait_stream(side)
    graphed.data.view(torch.uint8).copy_(start[0])
    graphed.scale.view(torch.int16).copy_(start[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.write(slots, rows)
    g = torch.Generator().manual_seed(2)
    lengths = [1, 3, 6]  # three sequences decoding, in blocks 1-4, 5-8 and 9-12
    for _ in range(8):
        step = torch.tensor([(1 + 4 * i + n // bs) * bs + n % bs for i, n in enumerate(lengths)])
        new_rows = torch.randn(batch, *row, generator=g) * torch.rand(batch, 1, 1, generator=g) * 20
        slots.copy_(step)
        rows.copy_(new_rows)
        graph.replay()
        eager.write(step.cuda(), new_rows.cuda())
        torch.cuda.synchronize()
        assert_same_bits(graphed, eager)
        lengths = [n + 1 for n in lengths]
