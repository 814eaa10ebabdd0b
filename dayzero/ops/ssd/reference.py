"""Mamba-2 SSD (structured state space duality) reference ops: the time step, the scan in recurrent and
chunk form, and the gated grouped RMSNorm on the mixer output.

Per head h (head_dim P, state size N; the H heads are split into G groups that share B and C, head h
reading group h // (H/G)), with the time step dt_t > 0 and A_h = -exp(A_log_h) < 0:

    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T        S in R^{P x N}
    y_t = S_t C_t + D_h x_t

``ssd_recurrent`` runs this token by token (decode); ``ssd_chunk`` computes the same thing with matmuls
over chunks of C tokens (prefill). With Λ_r = Σ_{i<=r} dt_i A (the in-chunk cumulative log decay, <= 0)
and S the state at the chunk start:

    y_r = Σ_{c<=r} e^{Λ_r - Λ_c} (C_r·B_c) dt_c x_c + e^{Λ_r} S C_r + D x_r
    S  <- e^{Λ_last} S + Σ_c e^{Λ_last - Λ_c} dt_c x_c B_c^T

Only differences Λ_r - Λ_c with c <= r are exponentiated, so nothing overflows. Sequences are packed flat
(``cu_seqlens`` [S+1], as in ``ops/kda``); all math runs in fp32 and the state is fp32.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dayzero.ops.kda.reference import _bounds, _uniform_len
from dayzero.ops.registry import register


@register("ssd_dt")
def ssd_dt(dt: torch.Tensor, dt_bias: torch.Tensor, limit: tuple[float, float] = (0.0, math.inf)) -> torch.Tensor:
    """Time step ``clamp(softplus(dt + dt_bias), *limit)`` in fp32. dt: [T, H]; dt_bias: [H]."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(limit[0], limit[1])


def _prep(x, dt, A, B, C):
    """fp32 copies, with B and C expanded from groups to heads: [T, G, N] -> [T, H, N]."""
    H, G = x.shape[1], B.shape[1]
    if H % G:
        raise ValueError(f"{H} heads cannot share {G} groups of B/C")
    B = B.float().repeat_interleave(H // G, dim=1)
    C = C.float().repeat_interleave(H // G, dim=1)
    return x.float(), dt.float(), A.float().reshape(H), B, C


def _initial(initial_state, S, H, P, N, device):
    if initial_state is None:
        return torch.zeros(S, H, P, N, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32, copy=True)  # never hand back (or write) the caller's tensor


def _skip(y, x, D):
    return y if D is None else y + D.float()[:, None] * x  # D: [H]


def _recurrent_batch(x, dt, A, B, C, S):
    # x: [b, L, H, P]; dt: [b, L, H]; B, C: [b, L, H, N]; S: [b, H, P, N] fp32
    decay = (dt * A).exp()  # [b, L, H]
    outs = []
    for t in range(x.shape[1]):
        inp = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]  # dt x B^T: [b, H, P, N]
        S = decay[:, t, :, None, None] * S + inp
        outs.append(torch.einsum("bhpn,bhn->bhp", S, C[:, t]))
    y = torch.stack(outs, 1) if outs else x.new_zeros(x.shape)  # [b, L, H, P]
    return y, S


@register("ssd_recurrent")
def ssd_recurrent(x, dt, A, B, C, D, initial_state, cu_seqlens):
    """Token-by-token scan. x: [T, H, P]; dt: [T, H] (> 0, from :func:`ssd_dt`); A: [H] (< 0);
    B, C: [T, G, N]; D: [H] or None; initial_state: [S, H, P, N] or None (zeros).
    Returns y [T, H, P] in x.dtype and the fp32 final state [S, H, P, N]."""
    T, H, P = x.shape
    N = B.shape[-1]
    bounds = _bounds(cu_seqlens)
    S, L = len(bounds), _uniform_len(bounds)
    S0 = _initial(initial_state, S, H, P, N, x.device)
    xf, dtf, Af, Bf, Cf = _prep(x, dt, A, B, C)
    if L is not None:  # the decode hot path: all sequences step together
        y, state = _recurrent_batch(*(t.reshape(S, L, *t.shape[1:]) for t in (xf, dtf)), Af,
                                    *(t.reshape(S, L, *t.shape[1:]) for t in (Bf, Cf)), S0)
        y = y.reshape(T, H, P)
    else:
        parts = [_recurrent_batch(xf[None, s:e], dtf[None, s:e], Af, Bf[None, s:e], Cf[None, s:e], S0[i:i + 1])
                 for i, (s, e) in enumerate(bounds)]
        y = torch.cat([p[0][0] for p in parts])
        state = torch.cat([p[1] for p in parts])
    return _skip(y, xf, D).to(x.dtype), state


def _chunk_seq(x, dt, A, B, C, S, chunk: int):
    """One sequence. x: [L, H, P]; dt: [L, H]; A: [H]; B, C: [L, H, N]; S: [H, P, N] fp32."""
    L, H, P = x.shape
    n = -(-L // chunk)

    def chunks(t):  # [L, H, *] -> [n, C, H, *]; zero padding: dt = 0 neither decays nor writes the state
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, n * chunk - L))
        return t.reshape(n, chunk, *t.shape[1:])

    xdt = chunks(x * dt[..., None])  # dt_c x_c: [n, C, H, P]
    Bc, Cc = chunks(B), chunks(C)  # [n, C, H, N]
    G = chunks(dt * A).cumsum(1)  # Λ: [n, C, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()  # [r, c]: c <= r
    outs = []
    for j in range(n):
        diff = G[j][:, None] - G[j][None]  # Λ_r - Λ_c: [C(r), C(c), H]
        decay = diff.masked_fill(~causal[..., None], float("-inf")).exp()
        scores = torch.einsum("rhn,chn->rch", Cc[j], Bc[j]) * decay  # [C, C, H]
        y = torch.einsum("rch,chp->rhp", scores, xdt[j])
        y = y + G[j].exp()[..., None] * torch.einsum("hpn,rhn->rhp", S, Cc[j])  # the carried state's part
        last = G[j][-1]  # [H]
        w = (last[None] - G[j]).exp()  # e^{Λ_last - Λ_c}: [C, H]
        S = last.exp()[:, None, None] * S + torch.einsum("ch,chp,chn->hpn", w, xdt[j], Bc[j])
        outs.append(y)
    if not outs:
        return x.new_zeros(0, H, P), S
    return torch.cat(outs)[:L], S


@register("ssd_chunk")
def ssd_chunk(x, dt, A, B, C, D, initial_state, cu_seqlens, chunk_size: int = 128):
    """The scan in chunk form (prefill); same arguments and result as :func:`ssd_recurrent`.
    Lengths need not be multiples of ``chunk_size`` (the last chunk is zero-padded)."""
    T, H, P = x.shape
    N = B.shape[-1]
    bounds = _bounds(cu_seqlens)
    S0 = _initial(initial_state, len(bounds), H, P, N, x.device)
    xf, dtf, Af, Bf, Cf = _prep(x, dt, A, B, C)
    outs, states = [], []
    for i, (s, e) in enumerate(bounds):
        y_i, S_i = _chunk_seq(xf[s:e], dtf[s:e], Af, Bf[s:e], Cf[s:e], S0[i], chunk_size)
        outs.append(y_i)
        states.append(S_i)
    y = torch.cat(outs) if outs else xf.new_zeros(0, H, P)
    return _skip(y, xf, D).to(x.dtype), torch.stack(states) if states else S0


@register("ssd_gated_norm")
def ssd_gated_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """Mamba-2's output norm: ``RMSNorm(x * silu(gate)) * weight``, the gate applied *before* the norm
    (``norm_before_gate=False``) and the mean square taken per group of ``group_size`` channels (one
    group per B/C group, so the result does not depend on how heads are split over ranks).
    x, gate: [T, I]; weight: [I]."""
    h = x.float() * F.silu(gate.float())
    h = h.unflatten(-1, (-1, group_size))  # [T, G, I/G]
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h.flatten(-2) * weight.float()).to(x.dtype)


@register("ssd_pooled")
def ssd_pooled(x, dt, A, B, C, D, state_pool: torch.Tensor, batch, chunk_size: int = 128):
    """The scan for the whole step over the state pool [num_slots + 1, H, P, N]: each sequence starts from its
    slot's state (zero when ``batch.fresh``), recurrent form when every sequence brings one token, chunk form
    otherwise; final states written back to the slots in place. Returns y [T, H, P] in x.dtype."""
    from dayzero.ops.kda.reference import pooled_state

    S0 = pooled_state(state_pool, batch)
    if batch.is_decode:
        y, state = ssd_recurrent(x, dt, A, B, C, D, S0, batch.cu_seqlens)
    else:
        y, state = ssd_chunk(x, dt, A, B, C, D, S0, batch.cu_seqlens, chunk_size)
    state_pool[batch.state_slots] = state
    return y
