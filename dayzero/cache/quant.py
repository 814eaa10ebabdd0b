"""Quantised paged pools for fp8 / int8 KV caches.

Value-like rows keep one scale per token row (per head); key-like rows keep one scale per channel per
block, because key outliers live in fixed channels (KIVI). A per-channel scale covers every token of
its block, so a write into a block re-derives the block's scale from the rows already there (dequantised)
and the new rows, and requantises the block. Only rows before the first offset written in this step
count as already there: stale rows left by an earlier owner of a reused block never influence a scale,
so results do not depend on what ran before. Scales are bf16 (fp32's range, half the bytes).
"""
from __future__ import annotations

import math

import torch

# quantised kinds -> storage dtype
KV_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
# plain kinds -> storage dtype (None: the model dtype)
PLAIN_KV_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
KV_CACHE_DTYPES = (*PLAIN_KV_DTYPES, *KV_DTYPES)
QMAX = {"fp8": 448.0, "int8": 127.0}
SCALE_DTYPE = torch.bfloat16


class QuantPagedPool:
    def __init__(self, num_blocks: int, block_size: int, row: tuple[int, ...], kind: str, per_channel: bool,
                 device, out_dtype: torch.dtype):
        if kind not in QMAX:
            raise ValueError(f"quantised kv_cache_dtype must be one of {list(KV_DTYPES)}, got {kind!r}")
        self.kind, self.qmax, self.per_channel = kind, QMAX[kind], per_channel
        self.block_size, self.row, self.out_dtype = block_size, tuple(row), out_dtype
        self.data = torch.zeros((num_blocks, block_size, *row), dtype=KV_DTYPES[kind], device=device)
        scale_shape = (num_blocks, *row) if per_channel else (num_blocks, block_size, *row[:-1])
        self.scale = torch.zeros(scale_shape, dtype=SCALE_DTYPE, device=device)

    @staticmethod
    def bytes_per_token(row: tuple[int, ...], per_channel: bool, block_size: int) -> float:
        n = math.prod(row)
        scales = n / block_size if per_channel else math.prod(row[:-1])
        return n * 1 + scales * SCALE_DTYPE.itemsize

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def _quant(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        q = (x / s).clamp(-self.qmax, self.qmax)
        return q.round().to(self.data.dtype) if self.kind == "int8" else q.to(self.data.dtype)

    def _scale_of(self, amax: torch.Tensor) -> torch.Tensor:
        # round the scale to its stored precision first, so quantising and dequantising use the same value
        return (amax / self.qmax).clamp(min=1e-8).to(SCALE_DTYPE).float()

    def _owners(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per written row n: its block, its offset, the representative of its block (the least n writing
        that block), its slot in the representatives' [N, block_size] scratch, and the row its slot takes
        (the least n writing that slot: only padding rows share a slot, and the choice must not depend on
        the order a device applies duplicate writes in). Fixed-shape scatters only, so no host sync."""
        n, bs, dev = slots.numel(), self.block_size, slots.device
        blocks, offs = slots // bs, slots % bs  # [N]
        idx = torch.arange(n, device=dev)
        rep = torch.full((self.data.shape[0],), n, device=dev).scatter_reduce_(0, blocks, idx, "amin")[blocks]  # [N]
        key = rep * bs + offs  # [N], in [0, N * bs)
        win = torch.full((n * bs,), n, device=dev).scatter_reduce_(0, key, idx, "amin")[key]  # [N]
        return blocks, offs, rep, key, win

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Store rows [N, *row] at slots [N] without a host sync, so a step that writes can be captured in
        a CUDA graph. Rows that share a slot (padding into the null block) store the first of them."""
        slots, rows = slots.long(), rows.float()
        blocks, offs, rep, key, win = self._owners(slots)
        if not self.per_channel:
            s = self._scale_of(rows.abs().amax(-1))  # [N, *row[:-1]]
            self.data.view(-1, *self.row)[slots] = self._quant(rows, s[..., None])[win]
            self.scale.view(-1, *self.row[:-1])[slots] = s.to(SCALE_DTYPE)[win]
            return
        bs, dev = self.block_size, slots.device
        # each written row gets a copy of its block; only the representatives' copies get the new rows
        first = torch.full((self.data.shape[0],), bs, device=dev).scatter_reduce_(0, blocks, offs, "amin")
        keep = torch.arange(bs, device=dev)[None, :] < first[blocks][:, None]  # [N, bs]: rows of earlier steps
        old = self.data[blocks].float() * self.scale[blocks].float()[:, None]  # [N, bs, *row] dequantised
        old = old * keep.view(*keep.shape, *([1] * len(self.row)))  # stale rows to zero (a product: -0 stays -0)
        old.view(-1, *self.row)[key] = rows[win]
        s = self._scale_of(old.abs().amax(1))  # [N, *row]
        # every row of a block writes its representative's values, so duplicate writes agree
        self.data[blocks] = self._quant(old, s[:, None])[rep]
        self.scale[blocks] = s.to(SCALE_DTYPE)[rep]

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        q = self.data.view(-1, *self.row)[slots].float()
        if self.per_channel:
            s = self.scale[slots // self.block_size].float()
        else:
            s = self.scale.view(-1, *self.row[:-1])[slots].float()[..., None]
        return (q * s).to(self.out_dtype)
