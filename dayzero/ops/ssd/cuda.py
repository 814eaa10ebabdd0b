"""The Mamba-2 scan's decode step on the device: every sequence advances one token from the state in its
slot (one gather, one ``index_copy_`` back), fresh sequences reset on the device; runs inside captured CUDA
graphs. Prefill chunks are refused (the reference's chunk form runs them)."""
from __future__ import annotations

import torch

from dayzero.ops.attention.cuda import _decode_only
from dayzero.ops.kda.reference import pooled_state
from dayzero.ops.registry import register
from dayzero.ops.ssd.reference import _prep, _skip


@register("ssd_pooled", "cuda", verifier=lambda x, dt, A, B, C, D, pool, batch, *a, **k: _decode_only(batch),
          note="one recurrent step for every decode row, state updated in the pool (PyTorch)")
def ssd_pooled_decode(x, dt, A, B, C, D, state_pool: torch.Tensor, batch, chunk_size: int = 128):
    # x: [B, H, P]; dt: [B, H]; A: [H]; B, C: [B, G, N]; state_pool: [slots, H, P, N] fp32 -> y [B, H, P]
    xf, dtf, Af, Bf, Cf = _prep(x, dt, A, B, C)
    S = pooled_state(state_pool, batch) * (dtf * Af).exp()[..., None, None]
    S = S + (dtf[..., None] * xf)[..., None] * Bf[:, :, None, :]  # + dt x B^T
    state_pool.index_copy_(0, batch.state_slots, S)
    return _skip(torch.einsum("bhpn,bhn->bhp", S, Cf), xf, D).to(x.dtype)
