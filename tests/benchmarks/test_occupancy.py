"""benchmarks/occupancy.py's residency arithmetic on the CPU, against the hardware's rules worked by hand: registers
go to a warp in units of 256 out of 65,536 an SM, at most 64 warps and 32 blocks an SM, shared memory with 1 KB
kept per block."""
from __future__ import annotations

import pytest

from benchmarks.occupancy import Launch, next_fits, per_sm, rows


@pytest.mark.parametrize("warps,regs,smem,want", [
    (4, 94, 4096, 5),     # 94 * 32 -> 3,072 a warp: 21 warps, 5 programs of 4
    (8, 128, 4096, 2),    # 4,096 a warp: 16 warps, 2 programs of 8
    (8, 252, 65536, 1),   # 8,064 a warp: 8 warps; shared memory would allow 3
    (4, 32, 64, 16),      # 1,024 a warp: 64 warps, 16 programs of 4 (the warp limit)
    (1, 16, 0, 32),       # 512 a warp: 128 warps by registers, 64 by the warp limit, 32 by the block limit
    (4, 32, 120000, 1),   # shared memory: 228 KB holds one program of 117 KB + 1 KB
])
def test_programs_an_sm_holds(warps, regs, smem, want):
    assert per_sm(Launch("k", 1, warps, regs, smem)) == want


def test_the_next_launch_fits_beside_the_one_before_only_where_registers_are_left():
    big = Launch("projection", 1604, 4, 94, 4096)  # 5 programs an SM on 132 SMs: 61,440 of 65,536 registers held
    kda = Launch("kda", 128, 8, 128, 4096)  # 32,768 registers a program
    small = Launch("norm", 1, 4, 32, 0)  # 4,096 registers a program
    assert next_fits(big, kda, 132) == 0.0
    assert next_fits(big, small, 132) == 1.0
    half = Launch("half", 264, 4, 64, 0)  # 2 programs of 8,192 an SM: 16,384 held, room for one kda program
    assert next_fits(half, kda, 132) == 1.0
    assert next_fits(half, Launch("kda", 396, 8, 128, 0), 132) == pytest.approx(132 / 396)


def test_rows_give_waves_and_the_register_file_share():
    table = rows([Launch("projection", 1604, 4, 94, 4096), Launch("kda", 128, 8, 128, 4096)], 132)
    assert table[0]["per_sm"] == 5 and table[0]["waves"] == pytest.approx(1604 / 660)
    assert table[0]["rf"] == pytest.approx(660 * 12288 / (132 * 65536))
    assert table[0]["next"] == 0.0 and table[1]["next"] is None
    assert table[1]["waves"] == pytest.approx(128 / 264)
