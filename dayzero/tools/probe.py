"""A runnable stand-in for a model too large to load: one layer of each distinct (attention, MLP) spec,
attention at full size, MoE and dense MLP narrowed (fewer and narrower experts, a narrower latent: which ops
run is set by the structure, not the width), a small vocabulary, zero weights. Running it through the
real model runner shows every op the model calls, with the shapes its attention layers really have.

Two steps run: a prefill, then a decode step of two sequences, one of them at a context longer than every
indexer top-k and sliding window (its earlier tokens are taken as cached), so sparse selection and
windowed paths run too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

from dayzero.config.spec import GQASpec, LayerSpec, MLASpec, MLPSpec, ModelSpec, MoESpec
from dayzero.engine.builder import assemble, prepare_weights
from dayzero.engine.request import Sequence
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.scheduler import ScheduledSeq
from dayzero.models.decoder import CausalLM
from dayzero.models.registry import build_model

NARROW = 128  # expert, latent and dense-MLP width in the probe (a multiple of the MXFP4 and FP8 block sizes)
_INIT = ("kaiming_uniform_", "kaiming_normal_", "uniform_", "normal_", "trunc_normal_", "xavier_uniform_",
         "xavier_normal_", "zeros_", "ones_", "constant_")


def _narrow(mlp):
    if isinstance(mlp, MoESpec):
        per_group = max(2, math.ceil(mlp.top_k / mlp.topk_group))
        experts = min(mlp.n_experts, mlp.n_group * per_group)
        return dataclasses.replace(mlp, n_experts=experts, intermediate_size=min(mlp.intermediate_size, NARROW),
                                   shared_intermediate_size=min(mlp.shared_intermediate_size, NARROW),
                                   latent_size=min(mlp.latent_size, NARROW) if mlp.latent_size else None)
    if isinstance(mlp, MLPSpec):
        return dataclasses.replace(mlp, intermediate_size=min(mlp.intermediate_size, NARROW))
    return mlp


def probe_spec(spec: ModelSpec) -> tuple[ModelSpec, list[list[int]]]:
    """The probe's spec, and for each probe layer the original layers it stands for."""
    keys: dict[str, int] = {}
    layers: list[LayerSpec] = []
    stands_for: list[list[int]] = []
    for l in spec.layers:
        mlp = _narrow(l.mlp)
        key = repr((l.attn, mlp))
        if key not in keys:
            keys[key] = len(layers)
            layers.append(dataclasses.replace(l, index=len(layers), mlp=mlp))
            stands_for.append([])
        stands_for[keys[key]].append(l.index)
    return dataclasses.replace(spec, vocab_size=min(spec.vocab_size, 512), layers=tuple(layers)), stands_for


def long_context(spec: ModelSpec) -> int:
    """Past every indexer top-k and sliding window, so the sparse and windowed paths run."""
    n = 16
    for l in spec.layers:
        if isinstance(l.attn, MLASpec) and l.attn.indexer is not None:
            n = max(n, l.attn.indexer.topk + 2)
        if isinstance(l.attn, GQASpec) and l.attn.sliding_window:
            n = max(n, l.attn.sliding_window + 2)
    return n


@contextlib.contextmanager
def skip_init():
    """Modules allocate their parameters without running initialisers (the probe zeroes them after)."""
    saved = {n: getattr(torch.nn.init, n) for n in _INIT if hasattr(torch.nn.init, n)}
    for n in saved:
        setattr(torch.nn.init, n, lambda t, *a, **k: t)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.nn.init, n, fn)


def build_uninitialised(spec: ModelSpec, dtype: torch.dtype, device) -> CausalLM:
    """The model as the engine builds it (quantised tensors where the config declares them), on ``device``
    with its parameters allocated but not initialised (fast for large ones), ready to run."""
    with skip_init():
        model = build_model(spec, dtype, device)
    prepare_like_engine(model, device)
    return model


def prepare_like_engine(model: CausalLM, device, compute: str = "bf16") -> None:
    """What the engine does after loading: packed MXFP4 experts get the shared conversion workspace."""
    from dayzero.layers.moe import attach_workspace
    from dayzero.quant.workspace import ExpertWorkspace

    attach_workspace(model, ExpertWorkspace(compute, device))


@torch.no_grad()
def fill_(p: torch.Tensor, values: torch.Tensor | None = None) -> None:
    """Set a parameter of any storage dtype to ``values`` (cast), or to zero."""
    if values is None:
        p.zero_()
    else:
        p.copy_(values.to(p.dtype))


@torch.no_grad()
def random_init_(model: torch.nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Random weights in place on the model's device (the rules the test checkpoints use); packed MXFP4
    codes get random bytes and FP8 tensors cast random values."""
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)

    def normal(p, mean, sd):
        return torch.randn(p.shape, generator=g, device=dev) * sd + mean

    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype == torch.uint8:  # MXFP4: random E2M1 codes, E8M0 scales of 2^-6
            v = (torch.full(p.shape, 121, device=dev) if leaf.endswith("scales")
                 else torch.randint(0, 256, p.shape, generator=g, device=dev))
        elif leaf == "A_log":
            v = torch.log(torch.rand(p.shape, generator=g, device=dev) * 15 + 1)
        elif "scale" in leaf:  # block-FP8 scales
            v = torch.full(p.shape, 1e-3, device=dev)
        elif leaf in ("dt_bias", "e_score_correction_bias", "b1", "b2") or "bias" in leaf:
            v = normal(p, 0.0, 0.1)
        elif "norm" in name:
            v = normal(p, 1.0, 0.1)
        elif "conv1d" in name:
            v = normal(p, 0.0, 1 / math.sqrt(p.shape[-1]))
        elif p.dtype == torch.float8_e4m3fn:  # block-FP8 codes, scaled by the 1e-3 scales above
            v = normal(p, 0.0, std * 1e3)
        else:
            v = normal(p, 0.0, std)
        fill_(p, v)


def build_probe(spec: ModelSpec, dtype: torch.dtype, device) -> CausalLM:
    model = build_uninitialised(spec, dtype, device)
    for p in model.parameters():
        fill_(p)
    prepare_weights(model)
    return model


def _seq(n_tokens: int, computed: int) -> Sequence:
    seq = Sequence("probe", 0, [1] * n_tokens, n_tokens, SamplingParams(max_tokens=1))
    seq.num_computed = computed
    return seq


def run_probe(spec: ModelSpec, dtype: torch.dtype, device, on_phase=None, on_model=None):
    """Build the probe (``on_model(model)`` sees it first) and run its two steps; ``on_phase(name)`` is
    called before each. Returns the probe model and, per probe layer, the original layers it stands for."""
    pspec, stands_for = probe_spec(spec)
    model = build_probe(pspec, dtype, device)
    if on_model is not None:
        on_model(model)
    bs, n_long = 16, long_context(pspec)
    built = assemble(model, torch.device(device), dtype, block_size=bs, max_model_len=n_long + 1, max_num_seqs=2,
                     max_num_batched_tokens=n_long + 1, num_cache_blocks=4 + math.ceil((n_long + 1) / bs))
    runner, cache = built.runner, built.cache
    short, long = _seq(9, 0), _seq(n_long + 1, n_long)
    cache.grow(short.seq_id, 9)
    cache.grow(long.seq_id, n_long + 1)
    for name, scheduled in (("prefill", [ScheduledSeq(short, 8)]), ("decode", None)):
        if on_phase is not None:
            on_phase(name)
        if scheduled is None:  # both sequences bring one token
            short.num_computed = 8
            scheduled = [ScheduledSeq(short, 1), ScheduledSeq(long, 1)]
        runner.execute(runner.build_batch(scheduled, cache))
    return model, stands_for
