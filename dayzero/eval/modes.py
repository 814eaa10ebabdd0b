"""Engine modes for ``dayzero eval --modes``: the same held-out instances through differently configured engines.

A precision mode, a cache option or a scheduling path that breaks the model shows as a drop in a task's accuracy,
and, more finely, as answers that differ from the first mode's: modes that only reschedule the same arithmetic
(chunked prefill, preemption, batch size, the prefix cache) in fp32 must give the first mode's answers exactly.
Each mode is a few ``LLM`` keyword arguments over the command's own; two also change how the instances run:
``prefix`` runs them twice and scores the second pass (served from the prefix cache), and ``preempt`` gives the
engine a cache a little larger than the longest sequence, so that the scheduler must preempt and recompute (its
note gives how often it did).
"""
from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import torch

from dayzero.eval.tasks import Instance


@dataclass(frozen=True)
class Mode:
    name: str
    what: str
    overrides: dict = field(default_factory=dict)
    twice: bool = False  # run every instance twice and score the second pass (the prefix cache's)
    tiny_cache: bool = False  # a cache a little larger than the longest sequence: the scheduler must preempt

    def kwargs(self, base: dict, insts: list[Instance], count, max_tokens) -> dict:
        """``base`` with this mode's settings; ``count(text)`` gives a prompt's tokens, ``max_tokens(inst)`` the
        tokens an answer may take (both sizing the tiny cache)."""
        out = {**base, **self.overrides}
        if self.twice and out.get("num_prefix_snapshots") is None:
            # room for every first-pass snapshot (the end of each prompt and every interval point): with fewer, the
            # second pass, in the first one's order, finds each one evicted by those after it (least recently used
            # order against a cyclic workload: 220 instances in 64 rows gave 16 of 9,432 prompt tokens)
            from dayzero.engine.engine import EngineConfig

            interval = out.get("prefix_snapshot_interval") or EngineConfig.prefix_snapshot_interval
            out["num_prefix_snapshots"] = sum(1 + count(i.prompt) // interval for i in insts)
        if self.tiny_cache:
            block = out.get("block_size") or 16
            longest = max(count(i.prompt) + max_tokens(i) for i in insts)
            out.update(block_size=block, num_cache_blocks=int(PREEMPT_ROOM * (-(-longest // block) + 1)) + 1)
        return out


PREEMPT_ROOM = 1.25  # the ``preempt`` mode's cache: this many times the blocks of the longest sequence

MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("default", "the engine as the other options configure it"),
    Mode("fp32", "float32 weights and activations", {"dtype": "float32"}),
    Mode("bf16", "bfloat16 weights and activations", {"dtype": "bfloat16"}),
    Mode("bf16-workspace", "packed MXFP4 experts converted into a bf16 workspace in every step",
         {"expert_compute": "bf16"}),
    Mode("fp8-workspace", "packed MXFP4 experts converted into an FP8 workspace", {"expert_compute": "fp8"}),
    Mode("fused-mxfp4", "packed MXFP4 experts read by the expert kernels themselves", {"expert_compute": "fused"}),
    Mode("fp8-activations", "packed MXFP4 experts in an FP8 workspace of 128x128 tiles, multiplied by activations "
                            "rounded to FP8", {"expert_compute": "fp8", "fp8_activations": True}),
    Mode("kv-fp8", "the paged cache in FP8 (e4m3, scaled)", {"kv_cache_dtype": "fp8"}),
    Mode("kv-int8", "the paged cache in INT8 (scaled)", {"kv_cache_dtype": "int8"}),
    Mode("chunk16", "chunked prefill: 16 tokens a step", {"max_num_batched_tokens": 16, "max_num_seqs": 16}),
    Mode("preempt", f"a cache of {PREEMPT_ROOM}x the longest sequence's blocks: sequences preempted and "
                    "recomputed", tiny_cache=True),
    Mode("batch1", "one sequence at a time", {"max_num_seqs": 1}),
    Mode("batch64", "up to 64 sequences a step", {"max_num_seqs": 64}),
    Mode("prefix", "every instance twice, the second pass scored (from the prefix cache)",
         {"enable_prefix_caching": True}, twice=True),
    Mode("no-prefix", "the prefix cache off", {"enable_prefix_caching": False}),
    Mode("tp2", "tensor parallel over two ranks (Gloo on CPUs, NCCL on GPUs)", {"tp": 2}),
    Mode("ep2", "the routed experts spread over two ranks", {"ep": 2}),
    Mode("dp2", "attention data parallel over two replicas (each its own sequences), the experts over both",
         {"dp": 2, "ep": 2}),
    Mode("async", "each step queued before the host reads the last one's samples", {"async_scheduling": True}),
    Mode("eager", "no CUDA graphs: every step eager", {"enforce_eager": True}),
)}


def mode_names(spec: str) -> list[str]:
    """The modes of a comma-separated list, checked; ValueError naming an unknown one."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in MODES]
    if bad or not names:
        raise ValueError(f"--modes: unknown mode {', '.join(bad) or '(none given)'}; the modes are "
                         f"{', '.join(MODES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--modes: a mode named twice in {spec!r}")
    return names


@dataclass
class ModeRun:
    mode: Mode
    texts: list[str]
    engine: str  # device and dtype the engine ran in
    preemptions: int = 0
    prefix_hit: float = 0.0  # share of the scored pass's prompt tokens served from the prefix cache

    def note(self) -> str:
        parts = [self.engine]
        if self.mode.tiny_cache:
            parts.append(f"{self.preemptions} preemptions")
        if self.mode.twice:
            parts.append(f"{self.prefix_hit:.0%} of prompt tokens from the prefix cache")
        return ", ".join(parts)


@contextlib.contextmanager
def engine_session(**kwargs):
    """An ``LLM`` built from ``kwargs`` for the block, closed after and its memory given back (the next engine of a
    run of several loads into it)."""
    from dayzero import LLM

    llm = LLM(**kwargs)
    try:
        yield llm
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_mode(mode: Mode, base: dict, insts: list[Instance], answers, max_tokens, count) -> ModeRun:
    """The instances' completions through an engine built for ``mode`` (``answers(llm, insts)`` runs them;
    ``count(text)``, a prompt's tokens, and ``max_tokens(inst)`` size the ``preempt`` mode's cache)."""
    with engine_session(**mode.kwargs(base, insts, count, max_tokens)) as llm:
        eng = llm.engine
        run = ModeRun(mode, answers(llm, insts), f"{eng.device} {str(eng.dtype).removeprefix('torch.')}")
        if mode.twice:
            before = eng.stats()
            run.texts = answers(llm, insts)
            after = eng.stats()
            queried = after["prefix_queried_tokens"] - before["prefix_queried_tokens"]
            run.prefix_hit = (after["prefix_hit_tokens"] - before["prefix_hit_tokens"]) / max(1, queried)
        run.preemptions = eng.stats()["preemptions"]
        return run
