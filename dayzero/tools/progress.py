"""Progress of the slow tools, on stderr (stdout keeps the report or the JSON): a line per stage, a bar per phase."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def note(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bar(total: int, desc: str, enabled: bool = True, unit: str = "step") -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, mininterval=0.5, disable=not enabled)
