"""Reading and writing rows of a paged pool, plain or quantised, by cache slot (slot = block * rows per
block + row). Layers write their new rows here; batch-wide ops read the keys they attend to."""
from __future__ import annotations

import torch

from dayzero.cache.quant import QuantPagedPool

Pool = torch.Tensor | QuantPagedPool  # [num_blocks, rows per block, *row], or its quantised form


def write_rows(pool: Pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
    # slots: [N] int64; rows: [N, *row]
    if isinstance(pool, torch.Tensor):
        pool.view(-1, *pool.shape[2:])[slots] = rows.to(pool.dtype)
    else:
        pool.write(slots, rows)


def read_rows(pool: Pool, slots: torch.Tensor) -> torch.Tensor:
    # slots: [...] int64 -> [..., *row] in the pool's compute dtype
    if isinstance(pool, torch.Tensor):
        return pool.view(-1, *pool.shape[2:])[slots]
    return pool.read(slots)


def slots_of(block_tables: torch.Tensor, key_pos: torch.Tensor, block_size: int, stride: int = 1) -> torch.Tensor:
    """Slots of key positions ``key_pos`` [B, N] (one row of positions per sequence) through the block tables
    [B, W]; positions outside the table (negative, or past its width) read column 0 or the last column:
    the caller masks them. ``stride`` > 1: a pool of one row per ``stride`` positions (compressed entries)."""
    pos = key_pos.clamp(min=0) * stride
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    per_block = -(-block_size // stride)
    return block_tables.gather(1, col) * per_block + (pos % block_size) // stride


def row_shape(pool: Pool) -> tuple[int, ...]:
    """The shape of one row of ``pool``."""
    return tuple(pool.shape[2:]) if isinstance(pool, torch.Tensor) else pool.row
