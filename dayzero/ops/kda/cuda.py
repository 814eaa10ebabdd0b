"""The pooled linear-attention ops on the device (KDA and Gated DeltaNet, the short causal conv).

``kda_pooled`` runs fla-core's kernels when fla is installed (the optional ``cuda`` extra): decode rows with
``fused_recurrent_kda_fwd``, which reads and writes each sequence's state in the pool in place by its slot in
one kernel; prefill and mixed chunks with ``chunk_kda`` over the step's packed rows (``cu_seqlens``) from the
sequences' pooled states (in a captured prefill step, fla's graph mode: its chunk list built on the device). fla's chunk kernel multiplies fp32 operands in TF32 (about 1e-3 relative), so fp32
activations keep the reference's chunk form unless ``DAYZERO_FLA_CHUNK=tf32`` allows it; ``DAYZERO_FLA_CHUNK=0``
turns the chunk kernel off for every dtype (a comparison). Without fla,
decode rows run the recurrent step in PyTorch (a gather, the update, one ``index_copy_`` back); prefill chunks
run the reference's chunk form. ``fresh`` sequences start from zero state: their slots are zeroed on the
device first. Fixed shapes and no host round trip on decode rows: they
run inside captured CUDA graphs.

The math of both paths is the reference's (``reference.py``): q and k L2-normalised per head inside the
kernel (eps 1e-6 under the root), the gate ``g`` (log decay) and ``beta`` computed before, fp32 states.
Padding rows of a captured step all use the null slot 0, which nothing reads.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from dayzero.ops.attention.cuda import _decode_only
from dayzero.ops.fla_import import quiet_fla_import
from dayzero.ops.kda.conv_kernels import causal_conv1d_pooled_triton, conv_refusal
from dayzero.ops.kda.reference import _prep, grouped, kda_pooled, pooled_state
from dayzero.ops.kda.slot_kernels import refusal as slot_refusal, zero_fresh_slots
from dayzero.ops.registry import call, register

try:  # fla-core: Triton kernels for KDA / Gated DeltaNet (optional, GPU only)
    with quiet_fla_import():
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
except Exception:  # noqa: BLE001 - absent, or a triton it cannot use: the PyTorch paths run
    chunk_kda = fused_recurrent_kda_fwd = None


def fla_chunk_enabled(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether prefill rows of activations in ``dtype`` may run fla's chunk kernel (``DAYZERO_FLA_CHUNK``)."""
    mode = os.environ.get("DAYZERO_FLA_CHUNK", "1")
    return mode != "0" and (dtype != torch.float32 or mode == "tf32")


def _uses_fla(q: torch.Tensor, state_pool: torch.Tensor) -> bool:
    return chunk_kda is not None and q.is_cuda and state_pool.dtype == torch.float32 and q.shape[-1] <= 256


def _kda_verify(q, k, v, g, beta, scale, state_pool, batch, *a, **kw) -> str | None:
    why = _decode_only(batch)
    if why is None or (_uses_fla(q, state_pool) and fla_chunk_enabled(q.dtype)):
        return None
    if _uses_fla(q, state_pool) and q.dtype == torch.float32 and fla_chunk_enabled():
        return f"{why} (fla's chunk kernel multiplies fp32 in TF32; DAYZERO_FLA_CHUNK=tf32 allows it)"
    if _uses_fla(q, state_pool):
        return f"{why} (fla's chunk kernel is off: DAYZERO_FLA_CHUNK=0)"
    return f"{why} (fla-core is not installed, or cannot run this shape)"


def _zero_fresh(state_pool: torch.Tensor, batch) -> None:
    """Zero the slots of sequences that start this step: a Triton launch writing only those; without it, all the
    rows' slots through ``index_fill_`` (the others the null slot, never read), the slot list made once per
    forward pass for every layer."""
    if slot_refusal(state_pool) is None:
        zero_fresh_slots(state_pool, batch.state_slots, batch.fresh)
        return
    memo = getattr(batch, "memo", None)
    slots = None if memo is None else memo.get("fresh_slots")
    if slots is None:
        slots = torch.where(batch.fresh, batch.state_slots, 0)
        if memo is not None:
            memo["fresh_slots"] = slots
    state_pool.index_fill_(0, slots, 0.0)


@register("kda_pooled", "cuda", verifier=_kda_verify,
          note="fla-core chunk kernel (prefill) and fused recurrent in place (decode); without fla, decode in PyTorch")
def kda_pooled_cuda(q, k, v, g, beta, scale: float, state_pool: torch.Tensor, batch, use_qk_l2norm: bool = True,
                    gate: tuple | None = None, zeroed: bool = False):
    # q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; state_pool: [slots, H, K, V] fp32 -> o [T, H, V]
    # gate (A_log, dt_bias, lower_bound): g and beta are the gate's input and beta's logits (reference.kda_pooled)
    in_kernel = gate is not None and batch.is_decode and _uses_fla(q, state_pool)
    if gate is not None and not in_kernel:
        g, beta = call("kda_gate", g, *gate), torch.sigmoid(beta.float())
    if not batch.is_decode and not (_uses_fla(q, state_pool) and fla_chunk_enabled(q.dtype)):
        return kda_pooled(q, k, v, g, beta, scale, state_pool, batch, use_qk_l2norm)  # the reference's chunk form
    if not _uses_fla(q, state_pool):
        return kda_pooled_decode(q, k, v, g, beta, scale, state_pool, batch, use_qk_l2norm)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # the kernels index rows as packed [T, H, D]
    if in_kernel:  # fla reads f and the logits in their dtype and activates them as it loads them
        g, beta = g.contiguous(), beta.contiguous()
        A_log, dt_bias, lower = gate
        activate = dict(A_log=A_log.reshape(-1), dt_bias=dt_bias.reshape(-1), lower_bound=lower,
                        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    else:
        g, beta = g.float().contiguous(), beta.float().contiguous()
        activate = {}
    if batch.is_decode:  # one token per sequence: [B, 1, H, *], the state read and written in its slot
        if not zeroed:  # (zeroed: the layer's conv launch zeroed the fresh slots)
            _zero_fresh(state_pool, batch)
        v1 = v[:, None]
        o, _ = fused_recurrent_kda_fwd(q[:, None], k[:, None], v1, g[:, None], beta[:, None],
                                       initial_state=state_pool, scale=scale, inplace_final_state=True,
                                       ssm_state_indices=batch.state_slots, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                       out=torch.empty_like(v1), **activate)  # every row is written: no zeros
        return o[:, 0]
    if batch.host_lengths:  # the chunk list from the host lengths: no device read. One host tensor for the pass:
        # fla caches the chunk list by the identity of its inputs, so the step's other KDA layers reuse it
        memo = batch.memo
        if "cu_seqlens_cpu" not in memo:
            memo["cu_seqlens_cpu"] = torch.tensor(batch.query_start, dtype=torch.int64)
        lengths = dict(cu_seqlens_cpu=memo["cu_seqlens_cpu"])
    else:  # a captured step: fla's graph mode builds a fixed-size chunk list on the device (one entry per chunk
        # of the step's rows, plus one per sequence, the rest marked empty)
        lengths = dict(use_graph=True, max_num_seqs=batch.num_seqs)
    o, state = chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=scale,
                         initial_state=pooled_state(state_pool, batch).contiguous(), output_final_state=True,
                         use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=batch.cu_seqlens, **lengths)
    state_pool.index_copy_(0, batch.state_slots, state.float())
    return o[0].to(v.dtype)


def kda_pooled_decode(q, k, v, g, beta, scale: float, state_pool: torch.Tensor, batch, use_qk_l2norm: bool = True):
    """Decode rows in PyTorch: q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H] -> o [B, H, V]."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prep(q, k, v, g, beta, scale, use_qk_l2norm)
    S = pooled_state(state_pool, batch) * g.exp()[..., None]  # decay the rows (K dim)
    err = v - torch.einsum("bhkv,bhk->bhv", S, k)  # v - S^T k
    S = S + (beta[..., None] * k)[..., None] * err[:, :, None, :]
    state_pool.index_copy_(0, batch.state_slots, S)
    return torch.einsum("bhkv,bhk->bhv", S, q).to(out_dtype)


def _conv_verify(x, weight, pool, batch, activation="silu", groups=1, reset=None) -> str | None:
    if conv_refusal(x, weight, pool, groups, reset) is None:
        return None
    return _decode_only(batch)


@register("causal_conv1d_pooled", "cuda", verifier=_conv_verify,
          note="Triton kernel for decode and prefill rows, window updated in the pool in place; without Triton, "
               "decode rows in PyTorch")
def causal_conv1d_pooled_cuda(x, weight, window_pool: torch.Tensor, batch, activation: str | None = "silu",
                              groups: int = 1, reset: torch.Tensor | None = None):
    # x: [T, C]; weight: [C, W] (or [C, 1, W]); window_pool: [slots, C, W-1] -> y [T, C] (groups G: [G, T, C/G])
    if conv_refusal(x, weight, window_pool, groups, reset) is None:
        return causal_conv1d_pooled_triton(x, weight, window_pool, batch, activation, groups, reset)
    if reset is not None:
        _zero_fresh(reset, batch)
    return grouped(causal_conv1d_pooled_decode(x, weight, window_pool, batch, activation), groups)


def causal_conv1d_pooled_decode(x, weight, window_pool: torch.Tensor, batch, activation: str | None = "silu"):
    """One conv step for every decode row in PyTorch, the window updated in the pool."""
    # x: [B, C]; weight: [C, W] (or [C, 1, W]); window_pool: [slots, C, W-1] -> y [B, C]
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    C = x.shape[1]
    u = torch.cat((pooled_state(window_pool, batch).float(), x.float()[:, :, None]), dim=2)  # [B, C, W], oldest first
    y = (u * weight.float().reshape(C, -1)).sum(-1)
    window_pool.index_copy_(0, batch.state_slots, u[:, :, 1:].to(window_pool.dtype))
    return (F.silu(y) if activation == "silu" else y).to(x.dtype)
