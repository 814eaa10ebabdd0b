"""Turn one row of logits per sequence into the next token.

Per row, in order:

1. penalties on the tokens the sequence already generated: repetition (divide a positive
   logit by the penalty, multiply a negative one), then presence (subtract once if seen) and
   frequency (subtract once per occurrence);
2. greedy rows (``params.greedy``) take the argmax, ties broken by the lowest id;
3. other rows: divide by the temperature, keep the ``top_k`` largest, keep the nucleus (the
   smallest set of most likely tokens whose mass reaches ``top_p``), drop tokens with
   ``p < min_p * p_max``, then sample.

Filtering runs on the whole batch at once with per-row parameters as tensors; a row without a
filter gets a no-op threshold. Sampling is an exponential race, ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. per token, which picks token ``i`` with probability ``p_i``. A row whose
request has a seed draws its ``E`` from its own generator, so its tokens depend only on its
seed and its logits, never on which other rows share the batch; the other rows draw from the
global RNG.

A row with NaN or inf in its logits gets token id ``-1`` and logprob NaN; the engine ends that
request with an error and the rest of the batch is unaffected. ``-inf`` counts as bad too: the
model's raw logits are always finite unless something overflowed.

The returned logprob is that of the chosen token under the model's raw distribution
(``log_softmax`` of the unprocessed logits), whatever the penalties and filters did.

Nothing here makes the host wait for the device: every branch is decided on the host values in
``params``, every per-row value goes up through pinned memory (``host_copy.to_device``), and no
shape depends on device data. ``SamplerOutput.to_host`` then brings the whole step's result back
in one device→host copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from dayzero import ops
from dayzero.engine.host_copy import to_device
from dayzero.engine.sampling_params import SamplingParams


class HostSample(NamedTuple):
    token_ids: list[int]   # [B]; -1 where the row's logits were not finite
    logprobs: list[float]  # [B]; NaN where the id is -1
    top: list[list[tuple[int, float]]] | None  # per row, (id, logprob) of the most likely tokens


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64; -1 where the row's logits were not finite
    logprobs: torch.Tensor   # [B] fp32; raw log-probability of token_ids, NaN where -1
    top_ids: torch.Tensor | None = None       # [B, K] the K most likely tokens of the raw distribution
    top_logprobs: torch.Tensor | None = None  # [B, K] their log-probabilities (K = the largest params.logprobs)
    rows: torch.Tensor | None = None  # [B, 2] fp64 (id, log-probability) where the sampling wrote them so

    def to_host(self, num_top: Sequence[int] | None = None) -> HostSample:
        """The step's results as Python lists, in a single device→host copy.

        ``num_top[i]`` trims row ``i``'s alternatives to its own count (default: all ``K``);
        ``top`` is None when the sampler computed no alternatives.
        """
        return self.copy_to_host(num_top).result()

    def copy_to_host(self, num_top: Sequence[int] | None = None) -> PendingSample:
        """Start the single device→host copy of :meth:`to_host` without waiting for it: on CUDA it is queued
        into page-locked memory behind the step's kernels, and :meth:`PendingSample.result` waits for it."""
        K = 0 if self.top_ids is None else self.top_ids.shape[1]
        cols = [self.token_ids[:, None], self.logprobs[:, None]]
        if K:
            cols += [self.top_ids, self.top_logprobs]
        # one fp64 buffer: fp64 holds every fp32 value (NaN and inf included) and every integer
        # below 2**53 exactly, so ids come back unrounded (fp32 would round ids above 2**24)
        if self.rows is not None and not K:
            dev = self.rows  # [B, 2] as the greedy kernel wrote it
        else:
            dev = torch.cat([c.to(torch.float64) for c in cols], dim=1)  # [B, 2 + 2K]
        if dev.device.type != "cuda":
            return PendingSample(dev, None, K, num_top)
        host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        host.copy_(dev, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return PendingSample(host, done, K, num_top)


@dataclass
class PendingSample:
    """A step's sampled rows on their way to the host (see :meth:`SamplerOutput.copy_to_host`)."""

    rows: torch.Tensor  # [B, 2 + 2K] fp64 on the host (or still being copied there)
    done: torch.cuda.Event | None
    K: int
    num_top: Sequence[int] | None

    def result(self) -> HostSample:
        if self.done is not None:
            self.done.synchronize()
        rows, K = self.rows.tolist(), self.K
        token_ids = [int(r[0]) for r in rows]
        logprobs = [r[1] for r in rows]
        if not K:
            return HostSample(token_ids, logprobs, None)
        n = [K] * len(rows) if self.num_top is None else self.num_top
        top = [[(int(r[2 + j]), r[2 + K + j]) for j in range(min(k, K))] for r, k in zip(rows, n)]
        return HostSample(token_ids, logprobs, top)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    g = torch.Generator(device=device)
    # manual_seed accepts [-2**63, 2**64); fold any Python int into that range
    g.manual_seed(seed % (1 << 64))
    return g


def penalised_rows(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]] | None) -> list[int]:
    """The rows whose penalties change their logits: penalised, with tokens generated already."""
    if output_token_ids is None:
        return []
    return [i for i, p in enumerate(params) if output_token_ids[i] and p.penalised]


def greedy_fast(logits: torch.Tensor) -> SamplerOutput:
    """The sampling of an all-greedy step without penalties or alternatives: the ``greedy_sample`` op (two Triton
    launches on CUDA), which also writes the (id, log-probability) rows the host copy takes."""
    rows = torch.empty(logits.shape[0], 2, dtype=torch.float64, device=logits.device)
    ids, logprobs = ops.call("greedy_sample", logits, rows)
    return SamplerOutput(token_ids=ids, logprobs=logprobs, rows=rows)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    output_token_ids: Sequence[Sequence[int]] | None) -> torch.Tensor:
    """Penalise, in place, the tokens each row has already generated; returns ``logits``.

    ``logits``: ``[B, V]`` fp32. Ids outside ``[0, V)`` in ``output_token_ids`` are ignored.
    """
    rows = penalised_rows(params, output_token_ids)
    if not rows:
        return logits
    V = logits.shape[1]
    dev = logits.device
    width = max(len(output_token_ids[i]) for i in rows)
    # ids: [R, L], padded (and out-of-range ids redirected) to a spare column V that is dropped
    ids = to_device([list(output_token_ids[i]) + [V] * (width - len(output_token_ids[i]))
                     for i in rows], torch.long, dev)
    ids = torch.where((ids >= 0) & (ids < V), ids, V)
    counts = torch.zeros(len(rows), V + 1, device=dev).scatter_add_(
        1, ids, torch.ones_like(ids, dtype=torch.float32))[:, :V]  # counts: [R, V]
    seen = counts > 0
    pen = to_device([[params[i].repetition_penalty, params[i].presence_penalty,
                      params[i].frequency_penalty] for i in rows], torch.float32, dev)  # [R, 3]
    rep, presence, frequency = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]  # each [R, 1]

    idx = to_device(rows, torch.long, dev)
    x = logits.index_select(0, idx)  # x: [R, V]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - presence * seen - frequency * counts
    # a tiny repetition penalty can overflow fp32; keep every value finite so that the later
    # shift by the row max never computes inf - inf
    fmax = torch.finfo(torch.float32).max
    logits.index_copy_(0, idx, x.clamp(-fmax, fmax))
    return logits


def _filter(z: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, on temperature-scaled logits ``z: [S, V]`` (in place).

    Each row's maximum must be 0 (the caller shifts), so ``exp(z)`` is ``p / p_max``.
    """
    S, V = z.shape
    dev = z.device
    top_k = [p.top_k if 0 < p.top_k < V else V for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]

    if any(k < V for k in top_k) or any(p < 1.0 for p in top_p):
        # stable sort: among equal logits the lower id ranks first, so a cut through a tie is
        # deterministic and does not depend on the batch
        sorted_z, order = z.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=dev)[None, :]
        drop = rank >= to_device(top_k, torch.long, dev)[:, None]  # drop: [S, V] in sorted order
        if any(p < 1.0 for p in top_p):
            probs = sorted_z.masked_fill(drop, float("-inf")).softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            # keep a token while the tokens ranked above it hold less than top_p; rank 0 has
            # mass_before == 0 < top_p and is always kept. Rows with top_p == 1 skip this:
            # rounding in the cumsum could otherwise cut a tail of tiny but nonzero tokens.
            p = to_device(top_p, torch.float32, dev)[:, None]
            drop |= (mass_before >= p) & (p < 1.0)
        z.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), float("-inf"))

    if any(p > 0.0 for p in min_p):
        # p < min_p * p_max  <=>  z < log(min_p), with z = log(p / p_max); min_p = 0 -> -inf
        threshold = to_device(min_p, torch.float32, dev).log()[:, None]
        z.masked_fill_(z < threshold, float("-inf"))
    return z


def _race(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one id per row of ``probs: [S, V]``: ``argmax(p / E)``, ``E ~ Exp(1)``."""
    S, V = probs.shape
    dev = probs.device
    noise = torch.empty_like(probs)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if len(unseeded) == S:
        noise.exponential_()
    elif unseeded:
        noise.index_copy_(0, to_device(unseeded, torch.long, dev),
                          torch.empty(len(unseeded), V, device=dev).exponential_())
    for r, g in enumerate(generators):
        if g is None:
            continue
        # drawn on the generator's own device, so a CPU generator also serves CUDA logits
        noise[r] = to_device(torch.empty(V, device=g.device).exponential_(generator=g),
                             torch.float32, dev)
    # Exp(1) can return 0; 0/0 would be NaN and argmax picks NaN, so keep E > 0
    noise.clamp_(min=torch.finfo(torch.float32).tiny)
    return (probs / noise).argmax(dim=-1)


class Sampler:
    """Stateless: all per-request state (seeds, generated ids) comes in with each call."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 output_token_ids: Sequence[Sequence[int]] | None = None) -> SamplerOutput:
        # logits: [B, V], any float dtype
        B, V = logits.shape
        if len(params) != B or len(generators) != B or (
                output_token_ids is not None and len(output_token_ids) != B):
            raise ValueError(f"sampler got {B} logit rows but {len(params)} params, "
                             f"{len(generators)} generators"
                             + ("" if output_token_ids is None
                                else f", {len(output_token_ids)} output_token_ids"))
        k = min(max((p.logprobs or 0) for p in params), V) if B else 0
        if k == 0 and all(p.greedy for p in params) and not penalised_rows(params, output_token_ids):
            return greedy_fast(logits)
        dev = logits.device
        x = logits.to(torch.float32, copy=True)  # the caller's logits are never modified
        ok = torch.isfinite(x).all(dim=-1)  # ok: [B]
        # zero the bad rows so nothing below turns them into NaN; their result is replaced
        x.masked_fill_(~ok[:, None], 0.0)
        log_z = torch.logsumexp(x, dim=-1)  # [B], normaliser of the raw distribution

        apply_penalties(x, params, output_token_ids)
        token_ids = x.argmax(dim=-1)  # right for greedy rows; argmax returns the first max

        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            idx = to_device(rows, torch.long, dev)
            sub = [params[i] for i in rows]
            z = x.index_select(0, idx)  # z: [S, V]
            # shift before dividing: (z - max) / T is <= 0, so a tiny T gives -inf, never inf
            z = (z - z.amax(dim=-1, keepdim=True)) / to_device(
                [p.temperature for p in sub], torch.float32, dev)[:, None]
            z = _filter(z, sub)
            token_ids.index_copy_(0, idx, _race(z.softmax(dim=-1), [generators[i] for i in rows]))

        chosen = logits.gather(1, token_ids[:, None]).squeeze(1).float()
        logprobs = torch.where(ok, chosen - log_z, float("nan"))
        token_ids = torch.where(ok, token_ids, -1)
        if k == 0:
            return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
        top, top_ids = (logits.float() - log_z[:, None]).topk(k, dim=-1)  # alternatives under the raw distribution
        return SamplerOutput(token_ids, logprobs, top_ids, torch.where(ok[:, None], top, float("nan")))
