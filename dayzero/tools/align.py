"""Alignment: the engine under test against a reference, layer by layer, on the same prompts.

Each prompt goes through our engine as one prefill chunk, with a forward hook on every decoder layer
that records the residual stream after it (``x + residual``); the final logits come from
``compute_logits``. The reference is either transformers' own implementation of the architecture
(``"hf"``, fp32 on the CPU) or the same checkpoint loaded by dayzero in fp32 on the CPU (``"fp32"``, our
reference ops). The two sides run one after the other, so only one model is in memory at a time.

Per layer: relative error ‖a−b‖/‖b‖ over every prompt token, max absolute error, mean per-token cosine
similarity, and the growth of the relative error over the previous layer. A layer fails when its relative
error is over the threshold (or not finite). The advice names the failing layers and the first layer whose
error grows by more than ``jump_factor`` over the previous one while within a factor 10 of the threshold:
the layers to keep in higher precision. End to end: top-1 agreement and KL(reference ‖ ours) of the
next-token distributions at every prompt position.

With images (vision-language checkpoints, :data:`~dayzero.tools.align_images.VISION_FAMILIES`), each prompt
holds one placeholder per image and both sides get the same pixel rows: every vision layer's output (each
tower block, the deep-stack mergers, the merger; over every patch or merged token of the prompt's images) is
compared with the same statistics, in rows of their own before the decoder layers', and the decoder layers
are compared over the whole widened prompt, image tokens included. The layers to keep in higher precision
are decoder layers (what ``high_precision_layers`` takes); a failing vision layer fails the run.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.tools.align_capture import Capture, capture_dayzero, check_precision, engine_kwargs
from dayzero.tools.align_images import VISION_KIND, prompt_inputs, with_images

# default relative-error thresholds by the dtype under test (the reference is always fp32)
THRESHOLDS = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
LOW_PRECISION_THRESHOLD = 1e-1  # a precision config that names an 8-bit or 4-bit format
LOW_PRECISION_NAMES = ("fp8", "e4m3", "e5m2", "int8", "int4", "fp4", "mxfp4", "nvfp4")
DEFAULT_LENGTHS = (6, 48, 300)
JUMP_FACTOR = 4.0


@dataclass
class LayerRow:
    index: int
    kind: str  # "<attention kind>+<mlp kind>", e.g. "dsa+moe"
    rel_err: float
    max_abs: float
    cosine: float
    growth: float | None  # rel_err / rel_err of the previous layer
    passed: bool
    note: str = ""
    name: str = ""  # a vision layer: "v<block>", "ds<j>" (deep-stack merger) or "merger"; "" for a decoder layer

    @property
    def label(self) -> str:
        return self.name or str(self.index)


@dataclass
class AlignResult:
    model: str
    reference: str  # "hf" | "fp32"
    reference_model: str
    dtype: str
    device: str
    precision: dict
    threshold: float
    jump_factor: float
    prompt_lengths: list[int]
    rows: list[LayerRow]
    first_failing: int | None
    jump_layer: int | None
    suggestions: list[int]
    top1: float  # fraction of positions whose argmax agrees
    kl_mean: float
    kl_max: float
    logits_rel_err: float
    by_kind: dict[str, dict] = field(default_factory=dict)
    reference_device: str = "cpu"
    random_weights: bool = False  # a bare config: the same random weights on both sides
    interrupted: bool = False  # Ctrl-C during the reference: the prompts both sides finished are compared
    prompts_planned: int = 0
    prompt_images: list[int] = field(default_factory=list)  # images in each compared prompt
    vision_rows: list[LayerRow] = field(default_factory=list)  # the tower's layers in the order they run
    vision_first_failing: int | None = None  # position in vision_rows
    vision_jump: int | None = None

    @property
    def passed(self) -> bool:
        return self.first_failing is None and self.vision_first_failing is None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["passed"] = self.passed
        return d

    def to_json(self) -> str:
        # NaN and inf are not JSON: a diverged layer is reported as a string
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return str(v)
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return v

        return json.dumps(clean(self.to_dict()), indent=2)


# --- inputs ---------------------------------------------------------------------------------------
def default_prompts(vocab_size: int, max_len: int, lengths=DEFAULT_LENGTHS, seed: int = 0,
                    avoid: set[int] | None = None) -> list[list[int]]:
    """Fixed token-id prompts of different lengths, drawn from the vocab (without the ``avoid`` ids, e.g. the
    image placeholder): no tokenizer needed."""
    from dayzero.tools.align_images import random_text

    g = torch.Generator().manual_seed(seed)
    if avoid:
        return [random_text(min(n, max_len), vocab_size, avoid, g) for n in lengths]
    return [torch.randint(0, vocab_size, (min(n, max_len),), generator=g).tolist() for n in lengths]


def text_prompts(path: str | Path, model: str | Path) -> list[list[int]]:
    from dayzero.engine.tokenizer import load_tokenizer

    lines = [l.rstrip("\n") for l in Path(path).read_text().splitlines() if l.strip()]
    if not lines:
        raise ValueError(f"{path}: no prompts (one per non-empty line)")
    tok = load_tokenizer(model)
    if tok is None:
        raise ValueError(f"{model} has no tokenizer: text prompts need one (leave out --prompts to use token ids)")
    return [tok.encode(l, add_special_tokens=False) for l in lines]


def default_threshold(dtype: str, precision: dict) -> float:
    low = any(isinstance(v, str) and any(n in v.lower() for n in LOW_PRECISION_NAMES) for v in precision.values())
    return LOW_PRECISION_THRESHOLD if low else THRESHOLDS.get(dtype, THRESHOLDS["bfloat16"])


def layer_kinds(spec) -> list[str]:
    return [f"{l.attn_kind or '-'}+{l.mlp_kind or '-'}" for l in spec.layers]


# --- comparison -----------------------------------------------------------------------------------
class _Acc:
    """Sums over prompts for one compared tensor: ‖a−b‖², ‖b‖², max |a−b|, per-token cosines."""

    def __init__(self):
        self.diff2 = self.ref2 = self.max_abs = self.cos_sum = 0.0
        self.tokens = 0

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        # [T, ...] -> [T, features]: a token's hyper-connection streams [n, D] count as one vector
        a, b = a.double().reshape(a.shape[0], -1), b.double().reshape(b.shape[0], -1)
        d = a - b
        self.diff2 += float((d * d).sum())
        self.ref2 += float((b * b).sum())
        self.max_abs = max(self.max_abs, float(d.abs().max())) if d.numel() else self.max_abs
        if not torch.isfinite(d).all():
            self.max_abs = math.inf
        self.cos_sum += float(torch.nn.functional.cosine_similarity(a, b, dim=-1).sum())
        self.tokens += a.shape[0]

    @property
    def rel(self) -> float:
        if not math.isfinite(self.diff2):
            return math.nan
        return math.sqrt(self.diff2 / self.ref2) if self.ref2 > 0 else (0.0 if self.diff2 == 0 else math.inf)

    @property
    def cosine(self) -> float:
        return self.cos_sum / max(self.tokens, 1)


def compare(ours: list[Capture], ref: list[Capture], kinds: list[str], threshold: float, jump_factor: float):
    """Per-layer rows, first failing layer, first jump, and the end-to-end numbers."""
    n_layers = len(kinds)
    accs = [_Acc() for _ in range(n_layers)]
    logit_acc = _Acc()
    agree = positions = 0
    kl_sum, kl_max = 0.0, 0.0
    notes: dict[int, str] = {}
    for o, r in zip(ours, ref):
        for i in range(n_layers):
            if i in r.notes:  # the reference only has this layer after the final norm: compare like with like
                accs[i].add(o.final, r.layers[i])
                notes[i] = r.notes[i]
            else:
                accs[i].add(o.layers[i], r.layers[i])
        logit_acc.add(o.logits, r.logits)
        agree += int((o.logits.argmax(-1) == r.logits.argmax(-1)).sum())
        positions += o.logits.shape[0]
        logp_ref = torch.log_softmax(r.logits.double(), -1)
        logq = torch.log_softmax(o.logits.double(), -1)
        kl = (logp_ref.exp() * (logp_ref - logq)).sum(-1)  # KL(reference ‖ ours) per position
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max())) if torch.isfinite(kl).all() else math.inf
    rows, first_failing, jump = _rows(accs, kinds, [""] * n_layers, threshold, jump_factor, notes)
    suggestions = sorted({r.index for r in rows if not r.passed} | ({jump} if jump is not None else set()))
    end = {"top1": agree / max(positions, 1), "kl_mean": kl_sum / max(positions, 1), "kl_max": kl_max,
           "logits_rel_err": logit_acc.rel}
    return rows, first_failing, jump, suggestions, end


def compare_vision(ours: list[Capture], ref: list[Capture], names: list[str], threshold: float, jump_factor: float):
    """Rows of the vision layers (``names``, in the order they run) over the prompts with images; first failing
    row and first jump (positions in the rows)."""
    accs = [_Acc() for _ in names]
    for o, r in zip(ours, ref):
        if not o.vision and not r.vision:
            continue  # a prompt without images
        if len(o.vision) != len(names) or len(r.vision) != len(names):
            raise ValueError(f"the reference's vision tower has {len(r.vision)} layers, ours {len(o.vision)}")
        for acc, a, b in zip(accs, o.vision, r.vision):
            if a.shape != b.shape:
                raise ValueError(f"vision layer output of shape {tuple(a.shape)} against the reference's {tuple(b.shape)}")
            acc.add(a, b)
    return _rows(accs, [VISION_KIND] * len(names), names, threshold, jump_factor)


def _rows(accs: list[_Acc], kinds: list[str], names: list[str], threshold: float, jump_factor: float,
          notes: dict[int, str] | None = None):
    notes = notes or {}
    rows, prev = [], None
    for i, (acc, kind, name) in enumerate(zip(accs, kinds, names)):
        rel = acc.rel
        growth = rel / prev if prev is not None and prev > 0 and math.isfinite(rel) else None
        passed = math.isfinite(rel) and rel <= threshold
        rows.append(LayerRow(i, kind, rel, acc.max_abs, acc.cosine, growth, passed, notes.get(i, ""), name))
        prev = rel
    first_failing = next((r.index for r in rows if not r.passed), None)
    jump = next((r.index for r in rows if r.growth is not None and r.growth > jump_factor and r.rel_err >= threshold / 10), None)
    return rows, first_failing, jump


def by_kind(rows: list[LayerRow]) -> dict[str, dict]:
    """Per layer kind: how many layers, mean and max relative error, geometric-mean growth over the previous layer."""
    out: dict[str, dict] = {}
    for kind in dict.fromkeys(r.kind for r in rows):
        rs = [r for r in rows if r.kind == kind]
        rels = [r.rel_err for r in rs]
        growth = [r.growth for r in rs if r.growth is not None and r.growth > 0]
        out[kind] = {
            "layers": [r.name or r.index for r in rs], "rel_err_mean": sum(rels) / len(rels), "rel_err_max": max(rels),
            "growth_gmean": math.exp(sum(map(math.log, growth)) / len(growth)) if growth else None,
        }
    return out


# --- the tool -------------------------------------------------------------------------------------
def _bare(model: str, reference_model: str, reference: str) -> bool:
    """Whether MODEL is a config without weights (compared with random weights, the same on both sides)."""
    from dayzero.tools.cli_options import has_weights

    bare, ref_bare = not has_weights(Path(model)), not has_weights(Path(reference_model))
    if bare != ref_bare or (bare and reference_model != model):
        raise ValueError(f"{model if bare else reference_model} has no weights: a bare config is compared with its "
                         f"own random weights, so leave out --reference-model or give checkpoints on both sides")
    if bare and reference == "hf":
        raise ValueError(f"{model} has no weights for transformers to load: use --reference fp32 (the config's "
                         f"random weights on both sides) or a checkpoint")
    return bare


def align(
    model: str | Path | None = None,
    *,
    reference: str = "auto",
    reference_model: str | Path | None = None,
    precision: dict | None = None,
    dtype: str | None = None,
    device: str | None = None,
    prompts: list[list[int]] | None = None,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    threshold: float | None = None,
    jump_factor: float = JUMP_FACTOR,
    num_threads: int | None = None,
    progress: bool = False,
    images: list | None = None,
) -> AlignResult:
    """Run ``model`` with the settings under test and a reference on the same prompts; compare layer by layer.

    ``reference``: "hf" (transformers, fp32, CPU), "fp32" (dayzero, fp32, CPU) or "auto" (hf when transformers
    knows the model_type, else fp32). ``reference_model`` defaults to ``model``. ``precision``: keyword
    arguments for ``LLM`` (its own ``dtype`` / ``device`` are used unless ``dtype`` / ``device`` are given).
    ``prompts``: token-id lists; default fixed prompts of ``lengths`` tokens drawn from the vocab. A bare
    config gets random weights (``load_format="dummy"``, the precision config's seed) on both sides, the
    reference then on the device under test, where the random weights are drawn. Ctrl-C while the reference
    runs compares the prompts both sides finished (``interrupted``); before that, it propagates.

    ``images`` (Pillow images or encoded bytes; vision-language checkpoints only): the default prompts each hold
    every image, their placeholders in the middle of the text; given prompts that hold placeholder tokens take
    the images in order, and prompts that hold none each get every image before their text.
    """
    from dayzero.models.registry import load_config
    from dayzero.tools.align_hf import capture_hf, hf_knows

    model = str(model or DEFAULT_MODEL)
    reference_model = str(reference_model or model)
    precision = dict(precision or {})
    check_precision(precision)
    file_dtype, file_device = precision.pop("dtype", None), precision.pop("device", None)
    dtype = dtype or file_dtype or "bfloat16"
    device = device or file_device or "auto"
    if reference not in ("auto", "hf", "fp32"):
        raise ValueError(f"reference must be 'auto', 'hf' or 'fp32', got {reference!r}")
    bare = _bare(model, reference_model, reference)
    if reference == "auto":
        reference = "hf" if not bare and hf_knows(reference_model) else "fp32"
    elif reference == "hf" and not hf_knows(reference_model):
        raise ValueError(f"{reference_model}: transformers is not installed or has no implementation of its model_type; "
                         f"use --reference fp32")
    spec = load_config(model)
    avoid, ph = None, []
    if images:
        from dayzero.tools.align_images import placeholder, special_ids, vision_config

        raw, family = vision_config(model)
        if reference_model != model:
            vision_config(reference_model)
        avoid, ph, image_token = special_ids(raw, family), placeholder(raw, family), family.image_token_id(raw)
    given = prompts is not None
    if prompts is None:
        prompts = default_prompts(spec.vocab_size, spec.max_position_embeddings - 1, lengths, avoid=avoid)
    if not prompts or any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    prompts = [list(p) for p in prompts]
    per_prompt = with_images(prompts, list(images), image_token, ph, middle=not given) if images else None
    bad = sorted({t for p in prompts for t in p if not 0 <= t < spec.vocab_size})
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {spec.vocab_size}), got {bad[:5]}")
    inputs = ref_inputs = None
    if images:
        inputs = prompt_inputs(model, prompts, per_prompt)
        ref_inputs = inputs if reference_model == model else prompt_inputs(reference_model, prompts, per_prompt)
        long = max(inputs + ref_inputs, key=lambda p: len(p.wide))
        if len(long.wide) >= spec.max_position_embeddings:
            raise ValueError(f"a prompt is {len(long.wide)} tokens with its images' tokens, past the context "
                             f"({spec.max_position_embeddings}): use shorter --lengths or smaller images")
        longest = len(long.wide)
    else:
        longest = max(map(len, prompts))
    if threshold is None:
        threshold = default_threshold(dtype, precision)

    dummy = {"load_format": "dummy", "seed": precision.get("seed", 0)} if bare else {}
    ours, spec, device = capture_dayzero(model, prompts, "model under test", progress, images=per_prompt,
                                         **engine_kwargs(dtype, device, precision, longest, num_threads=num_threads,
                                                          **dummy))
    if len(ours) < len(prompts):
        raise KeyboardInterrupt  # nothing to compare yet
    ref_device = device if bare else "cpu"  # random weights are drawn on the device they live on
    if reference == "hf":
        ref = capture_hf(reference_model, ref_inputs or prompts, spec.num_hidden_layers, progress)
    else:
        ref, ref_spec, _ = capture_dayzero(reference_model, prompts, "fp32 reference", progress, images=per_prompt,
                                           **engine_kwargs("float32", ref_device, {}, longest, num_threads=num_threads,
                                                            **dummy))
        if ref_spec.num_hidden_layers != spec.num_hidden_layers:
            raise ValueError(f"{reference_model} has {ref_spec.num_hidden_layers} layers, {model} has {spec.num_hidden_layers}")
    if not ref:
        raise KeyboardInterrupt
    done = prompts[:len(ref)]
    kinds = layer_kinds(spec)
    rows, first, jump, suggestions, end = compare(ours[:len(ref)], ref, kinds, threshold, jump_factor)
    vision_rows, vision_first, vision_jump = [], None, None
    if images:
        vision_rows, vision_first, vision_jump = compare_vision(ours[:len(ref)], ref, vision_names(model), threshold,
                                                                jump_factor)
    lengths_done = [len(p.wide) for p in inputs[:len(ref)]] if images else [len(p) for p in done]
    return AlignResult(
        model=model, reference=reference, reference_model=reference_model, dtype=dtype, device=device,
        precision=precision, threshold=threshold, jump_factor=jump_factor, prompt_lengths=lengths_done,
        rows=rows, first_failing=first, jump_layer=jump, suggestions=suggestions, by_kind=by_kind(vision_rows + rows),
        **end, reference_device="cpu" if reference == "hf" else ref_device, random_weights=bare,
        interrupted=len(ref) < len(prompts), prompts_planned=len(prompts),
        prompt_images=[len(i) for i in per_prompt[:len(ref)]] if images else [], vision_rows=vision_rows,
        vision_first_failing=vision_first, vision_jump=vision_jump,
    )


def vision_names(model: str | Path) -> list[str]:
    """The names of the checkpoint's vision layers in the order they run (the tower built on the meta device)."""
    from dayzero.tools.align_images import vision_config, vision_points

    raw, family = vision_config(model)
    with torch.device("meta"):
        tower = family.build(raw)
    return [p.name for p in vision_points(tower)]
