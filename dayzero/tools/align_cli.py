"""``dayzero align``: arguments in, report (or JSON) out; the exit status gates a deployment.

0: every layer passes; 1: a layer is over threshold; 2: the inputs are wrong; 130: interrupted (the report
then covers the prompts both sides finished)."""
from __future__ import annotations

import json
from pathlib import Path

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.tools.align import align, text_prompts
from dayzero.tools.align_images import read_images
from dayzero.tools.align_report import format_report, plot
from dayzero.tools.progress import note


def _precision(path: str | None) -> dict:
    if path is None:
        return {}
    try:
        with open(path) as f:
            cfg = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a precision config is a JSON object of LLM keyword arguments")
    return cfg


def _lengths(text: str) -> tuple[int, ...]:
    try:
        lengths = tuple(int(n) for n in text.split(","))
    except ValueError:
        lengths = ()
    if not lengths or any(n < 1 for n in lengths):
        raise ValueError(f"--lengths must be positive integers separated by commas, got {text!r}")
    return lengths


def run(args) -> int:
    lengths = _lengths(args.lengths)
    images = read_images(args.images or [])
    prompts = text_prompts(args.prompts, args.model or DEFAULT_MODEL) if args.prompts else None
    result = align(
        args.model, reference=args.reference, reference_model=args.reference_model,
        precision=_precision(args.precision), dtype=args.dtype, device=args.device, prompts=prompts,
        lengths=lengths, threshold=args.threshold, jump_factor=args.jump_factor, num_threads=args.num_threads,
        progress=True, images=images or None,
    )
    print(result.to_json() if args.json else format_report(result))
    if args.plot:
        plot(result, Path(args.plot))
        note(f"plot written to {args.plot}")
    if result.interrupted:
        note(f"interrupted: {len(result.prompt_lengths)} of {result.prompts_planned} prompts compared")
        return 130
    return 0 if result.passed else 1
