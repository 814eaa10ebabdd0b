"""``dayzero align``: arguments in, report (or JSON) out; the exit status gates a deployment."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from dayzero.cache.planner import CacheMemoryError
from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.tools.align import align, text_prompts
from dayzero.tools.align_report import format_report, plot


def _precision(path: str | None) -> dict:
    if path is None:
        return {}
    with open(path) as f:
        cfg = json.load(f)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: a precision config is a JSON object of LLM keyword arguments")
    return cfg


def run(args) -> int:
    """0 when every layer passes, 1 when one fails, 2 when the inputs are wrong."""
    try:
        lengths = tuple(int(n) for n in args.lengths.split(","))
        if any(n < 1 for n in lengths):
            raise ValueError(f"--lengths must be positive, got {args.lengths}")
        prompts = text_prompts(args.prompts, args.model or DEFAULT_MODEL) if args.prompts else None
        result = align(
            args.model, reference=args.reference, reference_model=args.reference_model,
            precision=_precision(args.precision), dtype=args.dtype, device=args.device, prompts=prompts,
            lengths=lengths, threshold=args.threshold, jump_factor=args.jump_factor,
        )
    except (ValueError, TypeError, OSError, CacheMemoryError) as e:  # TypeError: LLM refused a precision key
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(result.to_json() if args.json else format_report(result))
    if args.plot:
        plot(result, Path(args.plot))
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0 if result.passed else 1
