"""KDA's chunk form over B sequences of one width at once: the in-chunk work of every chunk of every sequence
in a few batched calls (the forward substitution as one triangular solve), then the loop over chunk positions
that carries the states. Autograd-safe (nothing is written in place).

Training runs it from zero states over its length buckets (:mod:`dayzero.train.linear_attention`); the CPU's
``kda_pooled`` (:mod:`dayzero.ops.kda.cpu`) runs it over the engine's prefill rows from the state pool, where
the reference (:func:`dayzero.ops.kda.reference.kda_chunk`) loops over sequences and substitutes row by row.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kda_chunk_batched(q, k, v, g, beta, C: int = 16, initial_state: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: [B, L, H, K] (q scaled and q, k normalised already); v: [B, L, H, V]; beta: [B, L, H]; fp32;
    initial_state: [B, H, K, V] fp32 or None (zeros). Returns o [B, L, H, V] and the final states [B, H, K, V].

    A sequence's padding must come after its real tokens with k = beta = 0 and g = 0: it then changes nothing
    the real tokens compute, and leaves the state as the last real token left it. The per-channel decays within
    a chunk are [B, H, L, C, K] (kept for the backward under autograd): chunks of 16 keep that a quarter of what
    chunks of 64 need, for four times the steps of the loop over chunks."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    C = max(1, min(C, L))  # short sequences: one chunk of their own length, not padded to a full one
    n = -(-L // C)

    def chunks(x):  # [B, L, H, *] -> [B, H, n, C, *]; zero padding: k = beta = 0 adds nothing, g = 0 keeps S
        x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, n * C - L))
        return x.reshape(B, n, C, *x.shape[2:]).movedim(3, 1)

    q, k, v, g = map(chunks, (q, k, v, g))  # [B, H, n, C, K|V]
    beta = chunks(beta[..., None])[..., 0]  # [B, H, n, C]
    G = g.cumsum(3)  # Γ_r within each chunk
    # e^{Γ_r - Γ_c} k_c for c <= r (differences <= 0, never overflowing; above the diagonal, where they are >= 0,
    # clamped to e^0 and cut off below), then every row r's products with k_r and q_r as one batched matmul
    D = (G[..., :, None, :] - G[..., None, :, :]).clamp(max=0).exp() * k[..., None, :, :]  # [B, H, n, r, c, K]
    A = torch.matmul(D, torch.stack((k, q), -1))  # [B, H, n, r, c, 2]
    del D
    A_kk = A[..., 0].tril(-1) * beta[..., None]  # L
    A_qk = A[..., 1].tril()
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    rhs = beta[..., None] * torch.cat((G.exp() * k, v), -1)  # Diag(beta) [e^Γ k | v]
    X = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    Wm, U = X.split([K, V], -1)
    G_C = G[..., -1, :]  # [B, H, n, K]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for j in range(n):
        Vp = U[:, :, j] - Wm[:, :, j] @ S  # V' = U - W S
        outs.append((q[:, :, j] * G[:, :, j].exp()) @ S + A_qk[:, :, j] @ Vp)
        decay = (G_C[:, :, j, None] - G[:, :, j]).exp() * k[:, :, j]  # e^{Γ_C - Γ_c} k_c
        S = G_C[:, :, j].exp()[..., None] * S + decay.transpose(-1, -2) @ Vp
    o = torch.stack(outs, 2)  # [B, H, n, C, V]
    return o.movedim(1, 3).reshape(B, n * C, H, V)[:, :L], S


def length_runs(lens: list[int], growth: float = 1.5) -> list[range]:
    """Cut non-decreasing lengths into runs of consecutive indices whose longest is at most ``growth`` times their
    shortest, so padding a run to its longest stays under that factor: training's length buckets and the CPU
    op's groups."""
    out, first = [], 0
    for i in range(1, len(lens) + 1):
        if i == len(lens) or lens[i] > growth * max(lens[first], 1):
            out.append(range(first, i))
            first = i
    return out
