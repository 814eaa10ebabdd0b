"""``dayzero profile MODEL``: latency and memory per layer for prefill and decode, grouped by layer kind,
with each kind's own costs split out (KDA state update, DSA indexer scoring and top-k vs attention, MoE
routing / expert compute / weight conversion / dispatch).

Three kinds of run, on the model runner the engine uses:
- plain steps, timed as a whole: the measured step time;
- steps with a hook on each decoder layer: per-layer times (and, on CUDA, each layer's transient peak);
- steps with hooks on every op call (the ops registry hook) and every linear projection as well: the
  split inside each layer. Whatever is left of the layer's time is glue ("other").
On CUDA every interval is a pair of CUDA events read after the step; on the CPU ``time.perf_counter``.
A checkpoint loads its weights; a bare config gets random ones (the numbers do not depend on the values).

With images (vision-language checkpoints, :data:`~dayzero.tools.align_images.VISION_FAMILIES`), each
sequence's prompt holds them before its text; a prefill step then encodes them (once a step: the sequences
share them, as the engine's encoder cache would) before the decoder runs, and the step time covers both.
Every tower block, deep-stack merger and the merger is timed as a layer of kind "vision", listed before the
decoder layers (their decode times are zero: decode steps do not run the tower).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from dayzero.layers.moe import MoE, expert_loads, reset_loads
from dayzero.ops import registry
from dayzero.tools import fmt
from dayzero.tools.progress import bar, note

PROJECTIONS, OTHER = "projections", "other"
# op name fragment -> the part of a layer it belongs to (first match wins; unknown ops keep their name)
PARTS = (
    ("linear", PROJECTIONS),  # the linear op outside a projection module; rms_norm_linear: a norm inside one
    ("indexer", "indexer score + top-k"),
    ("kda_gate", "gates"), ("kda_", "state update"), ("ssd_pooled", "state update"), ("ssd_chunk", "state update"),
    ("ssd_recurrent", "state update"), ("conv", "short conv"), ("gate", "gates"), ("ssd_dt", "gates"),
    ("mla", "attention"), ("attention", "attention"), ("compress_", "compression"),
    ("moe_route", "MoE routing"), ("moe_experts", "MoE expert compute"), ("permute", "MoE dispatch"),
    ("mxfp4", "MoE weight conversion"), ("dequant", "MoE weight conversion"), ("convert", "MoE weight conversion"),
    ("dispatch", "MoE dispatch"), ("combine", "MoE dispatch"), ("all_to_all", "MoE dispatch"),
    ("norm", "norms"), ("rotary", "rotary"), ("mlp", "dense MLP / shared experts"), ("silu", "activation"),
    ("relu", "activation"), ("swiglu", "activation"),
)
MOE_PARTS = ("MoE routing", "MoE expert compute", "MoE weight conversion", "MoE dispatch")
# ops that run other ops for parts of their own: each op called directly inside is timed as its part (renamed where
# given), the rest of the outer op's time as the outer op's part
CONTAINERS = {"moe_experts_routed": {"linear": "MoE routing"}}  # the router GEMV, then routing and experts


def part_of(op: str) -> str:
    return next((p for frag, p in PARTS if frag in op), op)


class _Clock:
    """Intervals on the device's own timeline: CUDA events, or perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _setup(model: str | None, device: str, dtype: str, batch: int, tokens: int, block_size: int = 16,
           progress: bool = False, num_threads: int | None = None, images: bool = False):
    """(model, runner, cache manager, spec, image runner) with caches for ``batch`` sequences of ``tokens``
    tokens; the image runner (the tower, its processor and encoder cache) only with ``images``, else None."""
    from dayzero.config.model_config import DTYPES
    from dayzero.engine.builder import assemble, prepare_weights
    from dayzero.engine.device import configure_threads, resolve_device
    from dayzero.engine.engine import EngineConfig, LLMEngine
    from dayzero.tools.model_info import load
    from dayzero.tools.probe import build_uninitialised, random_init_

    blocks = 1 + batch * -(-tokens // block_size)
    info = load(model)
    if info.checkpoint is not None:
        if progress:
            note(f"profile: loading {info.checkpoint}")
        eng = LLMEngine(EngineConfig(model=str(info.source), device=device, dtype=dtype, block_size=block_size,
                                     num_cache_blocks=blocks, max_num_seqs=batch, max_model_len=tokens,
                                     max_num_batched_tokens=max(2048, tokens * batch), enforce_eager=True,
                                     num_threads=num_threads))
        return eng.model, eng.runner, eng.cache, eng.model_config, eng.images if images else None
    dev = resolve_device(device)
    configure_threads(num_threads)
    dt = DTYPES[dtype] if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    if progress:
        note(f"profile: building {info.name} with random weights ({fmt.count(sum(p.logical for p in info.params))} "
             f"parameters) on {dev} in {str(dt).removeprefix('torch.')}")
    net = build_uninitialised(info.spec, dt, dev)
    family = None
    if images:
        from dayzero.multimodal.families import attach_tower
        from dayzero.tools.align_images import vision_config

        _, family = vision_config(info.source)
        with torch.device(dev):
            attach_tower(net, family, info.raw).to(dt)
    random_init_(net)
    prepare_weights(net)
    # eager: the profiler's hooks time each layer and op, which a replayed graph would skip
    built = assemble(net, dev, dt, block_size=block_size, max_model_len=tokens, max_num_seqs=batch,
                     max_num_batched_tokens=max(2048, tokens * batch), num_cache_blocks=blocks)
    image_runner = None
    if family is not None:
        from dayzero.engine.images import ImageRunner
        from dayzero.tools.align_images import processor_of

        image_runner = ImageRunner(family, net.visual, processor_of(info.source, info.raw, family), info.raw, dev, dt,
                                   cache_tokens=0)
    return net, built.runner, built.cache, info.spec, image_runner


class Profiler:
    """Runs prefill and decode steps of ``batch`` sequences of ``prompt_len`` tokens and times them. With an
    ``image_runner`` and ``images``, each prompt holds the images' placeholders (``placeholder``) before its
    ``prompt_len`` text tokens, and the tower's layers are timed before the decoder layers."""

    def __init__(self, model, runner, cache, spec, batch: int, prompt_len: int, steps: int, seed: int = 0,
                 image_runner=None, images=(), placeholder=(), avoid=()):
        from dayzero.engine.request import Sequence
        from dayzero.engine.sampling_params import SamplingParams
        from dayzero.tools.align_images import VISION_KIND, random_text, vision_points

        self.model, self.runner, self.cache, self.spec = model, runner, cache, spec
        self.steps = steps
        self.clock = _Clock(runner.device)
        self.image_runner = image_runner if images else None
        points = vision_points(image_runner.tower) if self.image_runner is not None else []
        self.names = [p.name for p in points] + list(range(len(spec.layers)))  # the vision layers, then the decoder's
        self.layers = [p.module for p in points] + list(model.model.layers)
        self.num_vision = len(points)
        self.kinds = [VISION_KIND] * len(points) + [f"{l.attn_kind or '-'}+{l.mlp_kind or '-'}" for l in spec.layers]
        g = torch.Generator().manual_seed(seed)
        n = prompt_len + steps
        if self.image_runner is None:
            self.ids = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for _ in range(batch)]
            mm = [None] * batch
        else:
            self.ids, mm = [], []
            for _ in range(batch):
                text = random_text(n, spec.vocab_size, set(avoid), g)
                wide, seq_images = self.image_runner.prepare(list(placeholder) * len(images) + text[:prompt_len],
                                                             list(images))
                self.ids.append(wide + text[prompt_len:])
                mm.append(seq_images)
            prompt_len = len(self.ids[0]) - steps
            n = prompt_len + steps
        self.prompt_len = prompt_len  # with the images' tokens
        self.seqs = [Sequence("profile", 0, ids[:prompt_len], prompt_len, SamplingParams(max_tokens=steps), images=m)
                     for ids, m in zip(self.ids, mm)]
        for s in self.seqs:
            if not cache.grow(s.seq_id, n):
                raise RuntimeError(f"the cache cannot hold {len(self.seqs)} sequences of {n} tokens")
        self.records: list[tuple[int | None, str, object, object]] = []  # (layer, part, start, end)
        self.peaks: dict[int, int] = {}
        self._layer: int | None = None
        self._depth = 0
        self._open: list | None = None  # [container op, its renames, the end of its last timed piece] while one runs

    # --- batches ---------------------------------------------------------------------------------------
    def _batch(self, start: int, n: int):
        from dayzero.engine.scheduler import ScheduledSeq

        for s, ids in zip(self.seqs, self.ids):
            s.token_ids = ids[:start + n]
            s.num_computed = start
        self._scheduled = [ScheduledSeq(s, n) for s in self.seqs]
        return self.runner.build_batch(self._scheduled, self.cache, eager=self.image_runner is not None)

    def prefill_batch(self):
        if self.image_runner is not None:  # every prefill encodes its images: none is in the cache yet
            self.image_runner.reset_cache()
        return self._batch(0, self.prompt_len)

    def decode_batch(self, k: int):
        return self._batch(self.prompt_len + k, 1)

    def step(self, batch) -> float:
        self.clock.sync()
        a = self.clock.mark()
        if self.image_runner is not None:  # the images' features (a prefill's tower calls) and 3-axis positions
            batch.images, batch.rope_positions = self.image_runner.step_inputs(self._scheduled)
        self.runner.execute(batch)
        b = self.clock.mark()
        self.clock.sync()
        return self.clock.seconds(a, b)

    # --- hooks -----------------------------------------------------------------------------------------
    def _install(self, ops: bool) -> list:
        handles, cuda = [], self.clock.cuda

        def pre(i):
            def hook(m, args):
                self._layer = i
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    self._mem0 = torch.cuda.memory_allocated()
                self._t0 = self.clock.mark()
            return hook

        def post(i):
            def hook(m, args, out):
                self.records.append((i, "layer", self._t0, self.clock.mark()))
                if cuda:
                    self.peaks[i] = max(self.peaks.get(i, 0), torch.cuda.max_memory_allocated() - self._mem0)
                self._layer = None
            return hook

        for i, layer in enumerate(self.layers):
            handles += [layer.register_forward_pre_hook(pre(i)), layer.register_forward_hook(post(i))]
        if ops:
            def lin_pre(m, args):
                self._depth += 1  # the linear op a projection module calls is part of the projection
                self._lin0 = self.clock.mark()

            def lin_post(m, args, out):
                self._depth -= 1
                if self._depth == 0:
                    self.records.append((self._layer, PROJECTIONS, self._lin0, self.clock.mark()))

            for layer in self.layers:
                for mod in layer.modules():
                    if hasattr(mod, "in_features") and hasattr(mod, "out_features"):  # nn.Linear, FP8 linears
                        handles += [mod.register_forward_pre_hook(lin_pre), mod.register_forward_hook(lin_post)]

            def op_hook(op, chosen, reason, fn, args, kwargs):
                box = self._open
                if self._depth and (box is None or self._depth > 1):  # an op inside an op is part of the outer one
                    return fn(*args, **kwargs)
                a = self.clock.mark()
                if box is not None:  # directly inside a container: the container's time so far, then this op's
                    self.records.append((self._layer, part_of(box[0]), box[2], a))
                elif op in CONTAINERS:
                    self._open = box = [op, CONTAINERS[op], a]
                    try:
                        self._depth += 1
                        return fn(*args, **kwargs)
                    finally:
                        self._depth -= 1
                        self.records.append((self._layer, part_of(op), box[2], self.clock.mark()))
                        self._open = None
                self._depth += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    b = self.clock.mark()
                    part = (box[1].get(op) or part_of(op)) if box is not None else part_of(op)
                    self.records.append((self._layer, part, a, b))
                    self._depth -= 1
                    if box is not None:
                        box[2] = b

            prev = registry.set_hook(op_hook)
            handles.append(_Restore(prev))
            # MXFP4 experts are converted by the shared workspace before a layer's experts run
            spaces = {id(w): w for m in self.model.modules() if (w := getattr(m, "workspace", None)) is not None}
            for ws in spaces.values():
                ws.acquire = self._timed(ws.acquire, "MoE weight conversion")
                handles.append(_Unwrap(ws, "acquire"))
        return handles

    def _timed(self, fn, part: str):
        def run(*args, **kwargs):
            self._depth += 1
            a = self.clock.mark()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.records.append((self._layer, part, a, self.clock.mark()))
        return run

    def _collect(self) -> dict[tuple[int | None, str], float]:
        self.clock.sync()
        out: dict = defaultdict(float)
        for layer, part, a, b in self.records:
            out[(layer, part)] += self.clock.seconds(a, b)
        self.records = []
        return out

    # --- the runs --------------------------------------------------------------------------------------
    def _phase(self, mode: str, phase: str, res: dict) -> None:
        """One prefill step, or a prefill then ``steps`` decode steps, with ``mode``'s hooks on."""
        if phase == "decode":
            self.step(self.prefill_batch())
        handles = self._install(mode == "ops") if mode != "plain" else []
        try:
            for i in range(1 if phase == "prefill" else self.steps):
                t = self.step(self.prefill_batch() if phase == "prefill" else self.decode_batch(i))
                res[mode][phase].append((t, self._collect()))
        finally:
            for h in handles:
                h.remove()

    def run(self, repeats: int = 3, warmup: int = 1, progress: bool = False) -> dict:
        """Plain, layer-timed and op-timed steps interleaved repeat by repeat, so that a machine whose speed
        drifts affects all three alike; medians over repeats (and decode steps). Ctrl-C during the measured
        rounds keeps what was measured: the summary has the phases measured in all three modes, and
        ``self.interrupted`` is set (during the warm-up, nothing is measured yet and it propagates)."""
        res = {m: {"prefill": [], "decode": []} for m in ("plain", "layers", "ops")}
        self.interrupted, self.rounds_done = False, 0
        with torch.inference_mode():
            if progress:
                note(f"profile: warm-up ({warmup} round{'s' * (warmup != 1)} of every step kind)")
            for _ in range(warmup):
                for mode in res:
                    for phase in ("prefill", "decode"):
                        self._phase(mode, phase, {m: {"prefill": [], "decode": []} for m in res})
            pbar = bar(repeats * 2 * len(res), "profile", progress)
            try:
                for r in range(repeats):
                    for phase in ("prefill", "decode"):
                        for mode in res:
                            pbar.set_postfix_str(f"round {r + 1}/{repeats}, {phase}, {mode}", refresh=False)
                            self._phase(mode, phase, res)
                            pbar.update()
                    self.rounds_done += 1
            except KeyboardInterrupt:
                self.interrupted = True
            finally:
                pbar.close()
        return self._summarise(res)

    def _summarise(self, res) -> dict:
        n = len(self.layers)
        out = {}
        for phase in ("prefill", "decode"):
            if not all(res[m][phase] for m in res):
                continue  # interrupted before this phase ran in every mode
            plain = statistics.median(t for t, _ in res["plain"][phase])
            timed = res["layers"][phase]
            layer_s = [statistics.median(r.get((i, "layer"), 0.0) for _, r in timed) for i in range(n)]
            coverage = statistics.median(sum(r.get((i, "layer"), 0.0) for i in range(n)) / t for t, r in timed if t)
            op_recs = [r for _, r in res["ops"][phase]]
            parts = []
            for i in range(n):
                names = {p for r in op_recs for (l, p) in r if l == i and p != "layer"}
                split = {p: statistics.median(r.get((i, p), 0.0) for r in op_recs) for p in names}
                split[OTHER] = max(0.0, layer_s[i] - sum(split.values()))
                parts.append(split)
            out[phase] = {"step_s": plain, "timed_step_s": statistics.median(t for t, _ in timed),
                          "layers_s": layer_s, "layers_sum_s": sum(layer_s), "coverage": coverage, "parts": parts}
            if self.num_vision:
                out[phase]["vision_s"] = sum(layer_s[:self.num_vision])
        if not out:
            raise KeyboardInterrupt  # interrupted before one phase was measured in every mode: nothing to report
        return out


class _Restore:
    def __init__(self, prev):
        self.prev = prev

    def remove(self):
        registry.set_hook(self.prev)


class _Unwrap:
    """Drops an instance attribute that wraps a method, so the class's method shows through again."""

    def __init__(self, obj, name: str):
        self.obj, self.name = obj, name

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else int(getattr(t, "nbytes", 0))


def profile(model: str | None = None, prompt_len: int = 128, batch: int = 1, steps: int = 8, device: str = "auto",
            dtype: str = "auto", repeats: int = 3, warmup: int = 1, progress: bool = False,
            num_threads: int | None = None, ep: int = 1, images: list | None = None) -> dict:
    """Per-layer and per-part times, and each MoE layer's routed load (grouped into ``ep`` expert-parallel ranks).
    ``interrupted`` in the result: Ctrl-C stopped the measured rounds, and ``phases`` lists those measured (the
    others' numbers are None). ``images`` (Pillow images or encoded bytes): each prompt holds them before its
    ``prompt_len`` text tokens; the vision layers are the first rows of ``layers`` (index "v0", ..., "merger")."""
    placeholder, avoid, image_tokens = [], set(), 0
    if images:
        from dayzero.engine.engine import DEFAULT_MODEL
        from dayzero.tools.align_images import placeholder as placeholder_of
        from dayzero.tools.align_images import processor_of, special_ids, vision_config

        source = model or DEFAULT_MODEL
        raw, family = vision_config(source)
        placeholder, avoid = placeholder_of(raw, family), special_ids(raw, family)
        image_tokens = sum(processor_of(source, raw, family)(list(images)).num_tokens)
    tokens = prompt_len + len(placeholder) * len(images or ()) + image_tokens - len(images or ()) + steps
    net, runner, cache, spec, image_runner = _setup(model, device, dtype, batch, tokens, progress=progress,
                                                    num_threads=num_threads, images=bool(images))
    prof = Profiler(net, runner, cache, spec, batch, prompt_len, steps, image_runner=image_runner,
                    images=list(images or ()), placeholder=placeholder, avoid=avoid)
    moe = {i: l.mlp for i, l in enumerate(net.model.layers) if isinstance(getattr(l, "mlp", None), MoE)}
    for m in moe.values():
        if m.spec.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide n_experts={m.spec.n_experts}")
    reset_loads(list(moe.values()))
    timing = prof.run(repeats, warmup, progress)
    loads = dict(zip(moe, expert_loads(list(moe.values()))))
    phases = [ph for ph in ("prefill", "decode") if ph in timing]
    layers = []
    for i, layer in enumerate(prof.layers):
        cache_bytes = sum(_nbytes(t) for m in layer.children() for t in (getattr(m, "cache", None) or {}).values())
        row = {"index": prof.names[i], "kind": prof.kinds[i]}
        for ph in ("prefill", "decode"):
            row[f"{ph}_s"] = timing[ph]["layers_s"][i] if ph in timing else None
        row.update({
            "weights_bytes": sum(p.numel() * p.element_size() for p in layer.parameters()),
            "cache_bytes": cache_bytes, "peak_transient_bytes": prof.peaks.get(i),
        })
        for ph in ("prefill", "decode"):
            row[f"{ph}_parts"] = timing[ph]["parts"][i] if ph in timing else {}
        layers.append(row)
    return {
        "model": str(model or "default"), "device": str(runner.device),
        "dtype": str(runner.cache_dtype).removeprefix("torch."),
        "prompt_len": prompt_len, "batch": batch, "steps": steps, "repeats": repeats,
        "images": len(images or ()), "image_tokens": image_tokens,
        "timer": "cuda events" if prof.clock.cuda else "perf_counter",
        "phases": phases, "interrupted": prof.interrupted, "rounds_done": prof.rounds_done,
        **{ph: ({k: v for k, v in timing[ph].items() if k != "parts"} if ph in timing else None)
           for ph in ("prefill", "decode")},
        "layers": layers, "by_kind": by_kind(layers, phases), "expert_load": expert_load_rows(loads, ep), "ep": ep,
    }


def expert_load_rows(loads: dict[int, torch.Tensor], ep: int = 1) -> list[dict]:
    """Per MoE layer (decoder layer index -> pairs per expert): the routed (token, expert) pairs, the busiest
    expert and its load over the mean, and the pairs each of ``ep`` expert-parallel ranks would compute."""
    rows = []
    for i, load in loads.items():
        total, mean = int(load.sum()), load.double().mean().item()
        ranks = load.view(ep, -1).sum(1)
        rows.append({"layer": i, "pairs": total, "hottest": int(load.argmax()),
                     "imbalance": load.max().item() / mean if mean else 1.0,
                     "rank_pairs": ranks.tolist(),
                     "rank_imbalance": ranks.max().item() / ranks.double().mean().item() if total else 1.0,
                     "per_expert": load.tolist()})
    return rows


def by_kind(layers: list[dict], phases: list[str]) -> list[dict]:
    """Per layer kind: layers, seconds per measured phase (None for the others) and the split by part; costliest first."""
    out: dict[str, dict] = {}
    zero = {f"{ph}_s": (0.0 if ph in phases else None) for ph in ("prefill", "decode")}
    for l in layers:
        k = out.setdefault(l["kind"], {"kind": l["kind"], "layers": 0, **zero, "parts": defaultdict(lambda: dict(zero))})
        k["layers"] += 1
        for ph in phases:
            k[f"{ph}_s"] += l[f"{ph}_s"]
            for p, v in l[f"{ph}_parts"].items():
                k["parts"][p][f"{ph}_s"] += v
        if "moe" in l["kind"]:
            for p in MOE_PARTS:
                k["parts"][p]  # listed even at zero: this build has no such op
    for k in out.values():
        k["parts"] = dict(k["parts"])
    return sorted(out.values(), key=lambda k: -total(k))


def total(row: dict) -> float:
    """Seconds over the measured phases of a layer, kind or part row."""
    return sum(row.get(f"{ph}_s") or 0.0 for ph in ("prefill", "decode"))


def main(args) -> int:
    from dayzero.tools.profile_report import plot, render

    from dayzero.tools.align_images import read_images

    images = read_images(getattr(args, "images", None) or [])
    r = profile(args.model, args.prompt_len, args.batch, args.steps, args.device, args.dtype, args.repeats,
                progress=True, num_threads=args.num_threads, ep=args.ep, images=images or None)
    if args.plot:
        plot(r, args.plot)
    print(json.dumps(r, indent=1, default=str) if args.json else render(r))
    if args.plot:
        print(f"plot written to {args.plot}", file=sys.stderr)
    if r["interrupted"]:
        note(f"interrupted: {r['rounds_done']} of {r['repeats']} rounds complete; the numbers are what was measured")
        return 130
    return 0
