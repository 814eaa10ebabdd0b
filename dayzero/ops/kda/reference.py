"""KDA (Kimi Delta Attention) reference ops: forget gate, short causal conv, recurrent and chunk forms.

Math: the KDA section of the architecture reference (ARCHITECTURE.md section 1). Per head, with state S in R^{K x V}:

    S_t = (I - b_t k_t k_t^T) Diag(e^{g_t}) S_{t-1} + b_t k_t v_t^T,        o_t = S_t^T q_t

``kda_recurrent`` runs this token by token (decode); ``kda_chunk`` computes the same thing with
matmuls over chunks of C tokens (prefill, section 1 "Chunk form for prefill").

Sequences are packed flat ("varlen"): ``cu_seqlens`` [N+1] int64 holds cumulative token counts and
sequence i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]`` (possibly none). All math runs in fp32; the
recurrent state is fp32 because it sums thousands of rank-1 updates.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dayzero.ops.registry import register


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = [int(c) for c in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def _uniform_len(bounds: list[tuple[int, int]]) -> int | None:
    """The length shared by every sequence (0 when there are none), or None when lengths differ."""
    lens = {e - s for s, e in bounds}
    if len(lens) > 1:
        return None
    return lens.pop() if lens else 0


@register("kda_gate")
def kda_gate(f, A_log, dt_bias, lower_bound: float | None = None) -> torch.Tensor:
    """Log-space per-channel forget gate, fp32 and <= 0.

    f: [T, H, K] (f_b(f_a x)); A_log: [H] (any shape with H elements); dt_bias: [H*K] head-major.
    Default ``-exp(A_log) * softplus(f + dt_bias)``; with ``lower_bound`` (K3's safe gate)
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``, which keeps g in [lower_bound, 0].
    """
    T, H, K = f.shape
    x = f.float() + dt_bias.float().view(H, K)  # [T, H, K]
    a = A_log.float().reshape(H, 1).exp()  # [H, 1]; reshape also accepts vLLM's [1, 1, H, 1]
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def _conv_batch(x, w, state, silu: bool):
    # x: [B, L, C]; w: [C, W] fp32; state: [B, C, W-1] -> y [B, L, C] fp32, window [B, C, W-1] fp32
    W, L = w.shape[1], x.shape[1]
    u = torch.cat([state.float(), x.float().transpose(1, 2)], dim=2)  # [B, C, W-1+L], oldest first
    y = sum(w[:, j, None] * u[:, :, j:j + L] for j in range(W))  # [B, C, L]: tap j reads u_{t-W+1+j}
    if silu:
        y = F.silu(y)
    return y.transpose(1, 2), u[:, :, u.shape[2] - (W - 1):]


@register("causal_conv1d")
def causal_conv1d(x, weight, conv_state, cu_seqlens, activation: str | None = "silu"):
    """Depthwise causal conv over time, continuing each sequence from its window of past inputs.

    x: [T, C]; weight: [C, W]; conv_state: [N, C, W-1], each sequence's last W-1 pre-activation
    inputs, oldest first (zeros for a new sequence). Returns y [T, C] in x.dtype and a new
    [N, C, W-1] window in conv_state.dtype (a short call keeps part of the old window).
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    T, C = x.shape
    w, silu = weight.float().reshape(C, -1), activation == "silu"  # also takes the ckpt's [C, 1, W]
    bounds = _bounds(cu_seqlens)
    N, L = len(bounds), _uniform_len(bounds)
    if L is not None:  # decode (one token each) and equal-length batches: one batched call
        y, state = _conv_batch(x.reshape(N, L, C), w, conv_state, silu)
        y = y.reshape(T, C)
    else:
        parts = [_conv_batch(x[None, s:e], w, conv_state[i:i + 1], silu) for i, (s, e) in enumerate(bounds)]
        y = torch.cat([p[0][0] for p in parts])
        state = torch.cat([p[1] for p in parts])
    return y.to(x.dtype), state.to(conv_state.dtype)


def _prep(q, k, v, g, beta, scale, use_qk_l2norm):
    """fp32 copies; q and k L2-normalised per head vector (eps 1e-6 inside the sqrt), q scaled."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * scale, k, v.float(), g.float(), beta.float()


def _initial(initial_state, N, H, K, V, device):
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=torch.float32, device=device)
    return initial_state.to(torch.float32, copy=True)  # never hand back (or write) the caller's tensor


def _recurrent_batch(q, k, v, g, beta, S):
    # q, k, g: [B, L, H, K]; v: [B, L, H, V]; beta: [B, L, H]; S: [B, H, K, V] fp32
    decay = g.exp()
    outs = []
    for t in range(q.shape[1]):
        S = decay[:, t, :, :, None] * S  # decay the rows (K dim)
        kt = k[:, t]  # [B, H, K]
        err = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, kt)  # v - S^T k
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * kt, err)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))  # S^T q
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)  # [B, L, H, V]
    return o, S


@register("kda_recurrent")
def kda_recurrent(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, use_qk_l2norm: bool = True):
    """Token-by-token KDA. q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] (log decay, <= 0);
    beta: [T, H]; initial_state: [N, H, K, V] fp32 or None (zeros).
    Returns o [T, H, V] in v.dtype and a new fp32 final state [N, H, K, V].
    """
    T, H, K = q.shape
    V = v.shape[-1]
    bounds = _bounds(cu_seqlens)
    N, L = len(bounds), _uniform_len(bounds)
    S0 = _initial(initial_state, N, H, K, V, q.device)
    xs = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    if L is not None:  # the decode hot path: all sequences step together
        o, S = _recurrent_batch(*(x.reshape(N, L, *x.shape[1:]) for x in xs), S0)
        return o.reshape(T, H, V).to(v.dtype), S
    outs, states = [], []
    for i, (s, e) in enumerate(bounds):
        o_i, S_i = _recurrent_batch(*(x[None, s:e] for x in xs), S0[i:i + 1])
        outs.append(o_i[0])
        states.append(S_i)
    return torch.cat(outs).to(v.dtype), torch.cat(states)


def _chunk_seq(q, k, v, g, beta, S, C: int):
    """One sequence. q, k, g: [L, H, K]; v: [L, H, V]; beta: [L, H]; S: [H, K, V] fp32. A sequence shorter than
    a chunk is one chunk of its own length (the form is exact at any chunk size; padding it to C would cost
    (C / L)^2 the work: a 15-token prompt in a 64-row chunk)."""
    L, H, K = q.shape
    V = v.shape[-1]
    C = max(1, min(C, L))
    n = -(-L // C)

    def chunks(x):  # [L, H, *] -> [n, H, C, *]; zero padding: k = beta = 0 adds nothing, g = 0 keeps S
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, n * C - L))
        return x.reshape(n, C, *x.shape[1:]).transpose(1, 2)

    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # [r, c]: c <= r
    outs = []
    for j in range(n):
        qj, kj, vj, bj = q[j], k[j], v[j], beta[j]  # [H, C, K], [H, C, K], [H, C, V], [H, C]
        G = g[j].cumsum(1)  # [H, C, K]: Γ_r, in-chunk cumulative log decay
        # e^{Γ_r - Γ_c} for c <= r, 0 above the diagonal; the difference is <= 0 so exp never overflows
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, C(r), C(c), K]
        D = diff.masked_fill(~causal[..., None], float("-inf")).exp()
        A_kk = torch.einsum("hrk,hrck,hck->hrc", kj, D, kj).tril(-1) * bj[..., None]  # L: [H, C, C]
        A_qk = torch.einsum("hrk,hrck,hck->hrc", qj, D, kj)  # [H, C, C], c <= r
        # [W | U] = (I + L)^{-1} Diag(beta) [e^Γ k | v], by forward substitution over the rows
        X = bj[..., None] * torch.cat([G.exp() * kj, vj], -1)  # [H, C, K+V]
        for r in range(1, C):
            X[:, r] -= torch.einsum("hc,hcd->hd", A_kk[:, r, :r], X[:, :r])
        Wm, U = X.split([K, V], -1)  # [H, C, K], [H, C, V]
        Vp = U - Wm @ S  # V' = U - W S: [H, C, V]
        outs.append((qj * G.exp()) @ S + A_qk @ Vp)  # [H, C, V]
        G_C = G[:, -1]  # [H, K]
        S = G_C.exp()[..., None] * S + ((G_C[:, None] - G).exp() * kj).transpose(1, 2) @ Vp
    if not outs:
        return v.new_zeros(0, H, V), S
    o = torch.stack(outs).transpose(1, 2).reshape(n * C, H, V)  # [n, H, C, V] -> [n*C, H, V]
    return o[:L], S


@register("kda_chunk")
def kda_chunk(q, k, v, g, beta, scale: float, initial_state, cu_seqlens,
              use_qk_l2norm: bool = True, chunk_size: int = 64):
    """KDA in chunk form (prefill); same arguments and result as :func:`kda_recurrent`.

    The last chunk of each sequence is zero-padded; lengths need not be multiples of chunk_size.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    bounds = _bounds(cu_seqlens)
    S0 = _initial(initial_state, len(bounds), H, K, V, q.device)
    xs = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    outs, states = [], []
    for i, (s, e) in enumerate(bounds):
        o_i, S_i = _chunk_seq(*(x[s:e] for x in xs), S0[i], chunk_size)
        outs.append(o_i)
        states.append(S_i)
    o = torch.cat(outs) if outs else v.new_zeros(0, H, V, dtype=torch.float32)
    return o.to(v.dtype), torch.stack(states) if states else S0


# --- batch-wide forms over the state pool ------------------------------------------------------------------
def pooled_state(pool: torch.Tensor, batch) -> torch.Tensor:
    """The step's sequences' rows of a state pool [slots, ...], zero for sequences that start this step."""
    state = pool[batch.state_slots]
    return torch.where(batch.fresh.view(-1, *([1] * (state.dim() - 1))), 0.0, state)


@register("kda_pooled")
def kda_pooled(q, k, v, g, beta, scale: float, state_pool: torch.Tensor, batch, use_qk_l2norm: bool = True,
               gate: tuple | None = None, zeroed: bool = False):
    """KDA for the whole step over the state pool: each sequence starts from its slot's state (zero when
    ``batch.fresh``), runs the recurrent form when every sequence brings one token and the chunk form
    otherwise, and its final state is written back to its slot in place. Returns o [T, H, V] in v.dtype.
    state_pool: [num_slots + 1, H, K, V] fp32. With ``gate`` = (A_log, dt_bias, lower_bound), ``g`` is the
    gate's input f and ``beta`` its logits: the op applies :func:`kda_gate` and the sigmoid itself (the device
    runs both inside its decode kernel). ``zeroed``: the fresh sequences' slots were zeroed already (by the conv
    op's ``reset``), which the device's decode path then need not do; this form reads them as zero either way."""
    if gate is not None:
        g, beta = kda_gate(g, *gate), torch.sigmoid(beta.float())
    form = kda_recurrent if batch.is_decode else kda_chunk
    o, state = form(q, k, v, g, beta, scale, pooled_state(state_pool, batch), batch.cu_seqlens, use_qk_l2norm)
    state_pool[batch.state_slots] = state
    return o


@register("causal_conv1d_pooled")
def causal_conv1d_pooled(x, weight, window_pool: torch.Tensor, batch, activation: str | None = "silu",
                         groups: int = 1, reset: torch.Tensor | None = None):
    """:func:`causal_conv1d` for the whole step over the window pool [num_slots + 1, C, W-1]: each sequence
    continues its slot's window (zeros when ``batch.fresh``) and leaves its new window there. Returns y [T, C],
    or with ``groups`` G > 1 the channels cut into G equal groups, [G, T, C/G], each group contiguous (KDA's q, k
    and v convolved in one call and handed on as three contiguous tensors). ``reset``: the layer's recurrent state
    pool [num_slots + 1, ...], whose fresh sequences' slots are zeroed too (the device does it in the conv's
    launch, so the delta rule after it needs none)."""
    y, window = causal_conv1d(x, weight, pooled_state(window_pool, batch), batch.cu_seqlens, activation)
    window_pool[batch.state_slots] = window.to(window_pool.dtype)
    if reset is not None:  # the null slot 0 stands in for the others: nothing reads it
        reset.index_fill_(0, torch.where(batch.fresh, batch.state_slots, 0), 0.0)
    return grouped(y, groups)


def grouped(y: torch.Tensor, groups: int) -> torch.Tensor:
    """[T, C] -> [G, T, C/G], contiguous (``groups`` 1: y itself)."""
    if groups == 1:
        return y
    T, C = y.shape
    if C % groups:
        raise ValueError(f"{C} channels do not cut into {groups} equal groups")
    return y.view(T, groups, C // groups).transpose(0, 1).contiguous()
