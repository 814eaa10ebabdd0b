"""Decode steps of the paged attention ops on the device, every sequence at once and with no host round trip:
each sequence brings one query row, its keys are gathered through its block table into a fixed-width
[B, keys] tile (the table's width, or the window, or the selected top-k), masked by the query's position
and softmaxed in fp32. Nothing depends on a host length, so these run inside captured CUDA graphs.

Same math as the per-sequence references (``paged.py``); rows of a prefill chunk are refused (the reference
runs them), with that reason in ``dayzero ops``, except where a Triton kernel takes them: ``paged_attention``
runs every row through the paged varlen kernel of ``triton_paged.py``, and absorbed MLA the split-K kernel of
``triton_mla.py``, for decode rows and for prefill rows with a DSA selection or a short context, each row
reading its sequence's table (``batch.seq_of_row``). Each kernel's ``refusal`` says when it cannot run (no
Triton, a quantised pool, ...); decode rows then take the plain PyTorch paths here.
"""
from __future__ import annotations

import torch

from dayzero.cache.rows import read_rows, slots_of
from dayzero.ops.attention import head_kernels, triton_mla, triton_paged
from dayzero.ops.attention.reference import sink_softmax
from dayzero.ops.registry import register

NOT_DECODE = "prefill rows: the per-sequence reference runs them"


def _decode_only(batch) -> str | None:
    return None if batch.is_decode else NOT_DECODE


def key_positions(batch, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key positions each decode row may read, [B, N], and whether each is a real causal key: every position of
    the block table (N = key width), or with a sliding window only the last ``window`` positions."""
    pos = batch.positions[:, None]  # [B, 1]: the query's position = its sequence's length - 1
    if window is not None and window < batch.key_width:
        kp = pos - window + 1 + torch.arange(window, device=pos.device)
        return kp, kp >= 0
    kp = torch.arange(batch.key_width, device=pos.device).expand(pos.shape[0], -1)
    return kp, kp <= pos  # a window at least as wide as the table excludes nothing


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ok: torch.Tensor, scale: float,
            sinks: torch.Tensor | None) -> torch.Tensor:
    # q: [B, Hkv, G, D] fp32; k: [B, N, Hkv, D]; v: [B, N, Hkv, Dv]; ok: [B, N] -> [B, Hkv, G, Dv] fp32
    s = torch.einsum("bkgd,bnkd->bkgn", q, k.float()) * scale
    s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
    sink = None if sinks is None else sinks.float().view(1, k.shape[2], -1, 1)
    p, denom = sink_softmax(s, sink)
    # rows not read are zeroed, not just weighted 0: a stale row of a reused block may hold inf/NaN
    v = v.float().masked_fill(~ok[:, :, None, None], 0.0)
    return torch.einsum("bkgn,bnkv->bkgv", p, v) / denom


def _attention_verify(q, k_cache, v_cache, batch, scale, sinks=None, window=None) -> str | None:
    if batch.is_decode:
        return None
    why = triton_paged.refusal(q, k_cache, v_cache, sinks, window)
    return None if why is None else f"{NOT_DECODE} ({why})"


@register("paged_attention", "cuda", verifier=_attention_verify,
          note="every row by the Triton paged varlen kernel (flash-style, windows and sinks); without it decode "
               "rows in PyTorch and prefill rows by the reference")
def paged_attention_rows(q: torch.Tensor, k_cache, v_cache, batch, scale: float, sinks: torch.Tensor | None = None,
                         window: int | None = None) -> torch.Tensor:
    # q: [T, H, Dqk] -> [T, H, Dv]
    if triton_paged.refusal(q, k_cache, v_cache, sinks, window) is None:
        return triton_paged.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.cu_seqlens,
                                            batch.positions, batch.block_size, scale, sinks, window)
    assert batch.is_decode, "prefill rows without the Triton kernel are the reference's (the verifier says so)"
    return paged_attention_decode(q, k_cache, v_cache, batch, scale, sinks, window)


def paged_attention_decode(q: torch.Tensor, k_cache, v_cache, batch, scale: float, sinks: torch.Tensor | None = None,
                           window: int | None = None) -> torch.Tensor:
    """Decode rows in PyTorch, whatever the device (the fallback; tests, benchmarks)."""
    # q: [B, H, D] (one row per sequence) -> [B, H, Dv]
    B, H, D = q.shape
    kp, ok = key_positions(batch, window)
    slots = slots_of(batch.block_tables, kp, batch.block_size)  # [B, N]
    k, v = read_rows(k_cache, slots), read_rows(v_cache, slots)  # [B, N, Hkv, D], [B, N, Hkv, Dv]
    Hkv = k.shape[2]
    o = _attend(q.float().view(B, Hkv, H // Hkv, D), k, v, ok, scale, sinks)
    return o.reshape(B, H, -1).to(q.dtype)


# Dense (no selection) prefill rows take the absorbed kernel up to this many keys per sequence: the DSA layers'
# short-context shortcut (every causal key within the top-k) and short contexts. Past it the naive form's
# fewer FLOPs per key (H*(N+P+V) against H*(2R+P)) pay for expanding the latents: the reference runs them.
DENSE_PREFILL_MAX_KEYS = 4096


def _kernel_refusal(q_pe, kv_b_weight, latent_cache, selection) -> str | None:
    """Why the Triton MLA kernel cannot take these rows, judged from the absorbed query's shape [T, H, R+P]
    before it is computed."""
    return triton_mla.rows_refusal(q_pe, (*q_pe.shape[:2], kv_b_weight.shape[-1] + q_pe.shape[-1]), latent_cache,
                                   selection)


def _mla_verify(q_nope, q_pe, latent_cache, kv_b_weight, v_head_dim, batch, scale, sinks=None, selection=None):
    if batch.is_decode:
        return None
    why = _kernel_refusal(q_pe, kv_b_weight, latent_cache, selection)
    if why is None and selection is None and batch.key_width > DENSE_PREFILL_MAX_KEYS:
        why = f"dense rows over {batch.key_width} keys (the absorbed kernel takes up to {DENSE_PREFILL_MAX_KEYS})"
    return None if why is None else f"{NOT_DECODE} ({why})"


@register("paged_mla", "cuda", verifier=_mla_verify,
          note="absorbed rows over the block tables or the DSA selection (Triton split-K kernel; decode rows "
               "also in PyTorch); long dense prefill rows use the reference")
def paged_mla_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache, kv_b_weight: torch.Tensor,
                   v_head_dim: int, batch, scale: float, sinks: torch.Tensor | None = None,
                   selection: torch.Tensor | None = None) -> torch.Tensor:
    # q_nope: [T, H, N]; q_pe: [T, H, P]; kv_b_weight: [H*(N+V), R]; selection: [T, topk] or None -> [T, H, V]
    return _mla_rows(q_nope, q_pe, latent_cache, kv_b_weight, v_head_dim, batch, scale, sinks, selection, True)


def paged_mla_decode_torch(q_nope: torch.Tensor, q_pe: torch.Tensor, latent_cache, kv_b_weight: torch.Tensor,
                           v_head_dim: int, batch, scale: float, sinks: torch.Tensor | None = None,
                           selection: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_mla_rows`` on decode rows on its PyTorch path whatever the device (tests, benchmarks)."""
    return _mla_rows(q_nope, q_pe, latent_cache, kv_b_weight, v_head_dim, batch, scale, sinks, selection, False)


def _mla_rows(q_nope, q_pe, latent_cache, kv_b_weight, v_head_dim, batch, scale, sinks, selection, use_triton):
    B, H, N = q_nope.shape
    w = kv_b_weight.view(H, N + v_head_dim, -1)  # per head: N rows of W_UK, then V rows of W_UV
    R = w.shape[-1]
    use_triton = use_triton and _kernel_refusal(q_pe, kv_b_weight, latent_cache, selection) is None
    # The kernel rounds q~ to the pool's dtype for its dots, so with a bf16 / fp16 model q~ is computed in that
    # dtype (its GEMM accumulates in fp32) from the weights as stored, and the output's latent rows meet W_UV in
    # it too: no fp32 copy of the weights per call, half the transient bytes. fp32 models, and the PyTorch
    # path, stay in fp32.
    ct = q_nope.dtype if use_triton else torch.float32
    # the absorbed query q~ = [q_nope W_UK | q_pe], one shared latent key/value head
    # q_nope comes from the query's projection, two launches or more back (the latent row's write between): the
    # product reads it before its wait
    q_lat = _head_product(q_nope.to(ct), w[:, :N], kv_b_weight, ct, use_triton, early=True)  # [T, H, R]
    # the kernel reads q~'s two parts apart and writes o_lat in ct: no concatenation, no cast. Its keys (the latent
    # rows, tables, selection) were written before q~'s product, the kernel just before it: it reads them early
    if use_triton:
        seq_of_row = None if batch.is_decode else batch.seq_of_row  # prefill rows read their sequence's table
        o_lat = triton_mla.mla_decode(q_lat, latent_cache, batch.block_tables, batch.positions, batch.block_size,
                                      R, scale, sinks, selection, seq_of_row=seq_of_row, q_pe=q_pe.to(ct),
                                      out_dtype=ct, early=True, merge=False)  # [T, H, R] or its splits
    else:
        assert batch.is_decode, "prefill rows without the Triton kernel are the reference's (the verifier says so)"
        q_abs = torch.cat((q_lat, q_pe.to(ct)), dim=-1)  # [B, H, R+P]
        if selection is None:
            kp, ok = key_positions(batch)
        else:
            kp, ok = selection, selection >= 0
        lat = read_rows(latent_cache, slots_of(batch.block_tables, kp, batch.block_size)).float()  # [B, K, R+P]
        o_lat = _attend(q_abs[:, None], lat[:, :, None], lat[:, :, None, :R], ok, scale, sinks)[:, 0]  # [B, H, R]
    if not isinstance(o_lat, triton_mla.Partials):
        o_lat = o_lat.to(ct)
    return _head_product(o_lat, w[:, N:].transpose(1, 2), kv_b_weight, ct, use_triton).to(q_nope.dtype)


# rows the per-head kernel takes here: against the einsum, a product at dayzero-small's shapes on the H100 ran
# 2.09x at one row, 1.82x at two, 1.21x at four and 0.61x at eight (1.74, 2.00, 3.02 and 6.04 us)
HEAD_KERNEL_ROWS = 4


def _head_product(x: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, ct: torch.dtype,
                  use_triton: bool, early: bool = False) -> torch.Tensor:
    """``x [T, H, I]`` times each head's ``w [H, I, J]`` (a view of the model weight ``weight``) in ``ct``: one
    Triton launch for a decode step's few rows (:mod:`head_kernels`), else an einsum (a batched GEMM)."""
    static = weight if w.dtype == ct else None  # a converted copy is made in the step: not read early
    w = w.to(ct)
    parts = x if isinstance(x, triton_mla.Partials) else None  # MLA's o_lat as its splits' partials
    rows = parts.out if parts is not None else x
    if use_triton and rows.shape[0] <= HEAD_KERNEL_ROWS and head_kernels.refusal(rows, w) is None:
        if parts is not None:  # merged as the product reads them: no merge launch
            return head_kernels.merged_head_product(parts, w, static)
        return head_kernels.head_product(x, w, static, early=early)
    if parts is not None:
        x = triton_mla.merge_partials(parts)
    return torch.einsum("thi,hij->thj", x, w)
