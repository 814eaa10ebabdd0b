"""fla-core (optional: fla's Triton kernels for KDA and the training forward's fused ops): importing it without its
CPU warning, and cutting its kernels' autotuning."""
from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings


@contextlib.contextmanager
def quiet_fla_import():
    """Around an import of fla-core: without a GPU it warns at import that it "rolls back to CPU", which tells our
    users nothing (its kernels run on CUDA tensors only, and on the CPU through the interpreter in the tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        yield


def _autotuners(obj):
    """The Triton autotuners inside a kernel object (``triton.heuristics`` may wrap them)."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if obj is None:
            return
        if isinstance(obj, Autotuner):
            yield obj
        obj = getattr(obj, "fn", None)


def _pick(configs: list, keep: int) -> list:
    """A moderate config (4 warps, few stages, large blocks) and the most conservative one."""
    ints = lambda c: [v for v in c.kwargs.values() if isinstance(v, int)]  # noqa: E731
    moderate = min(configs, key=lambda c: (abs(math.log2(c.num_warps / 4)), abs(c.num_stages - 2),
                                           -min(ints(c), default=0)))
    small = min(configs, key=lambda c: (c.num_warps, c.num_stages, max(ints(c), default=0)))
    return [moderate] + ([small] if keep > 1 and small is not moderate else [])


_LIMITED = False


def limit_fla_autotuning(keep: int | None = None) -> int:
    """Cut every fla kernel's autotuning to ``keep`` configs (the full search compiles and times about 200
    kernels on a fresh machine, minutes of a short training run); ``DAYZERO_FLA_AUTOTUNE=full`` keeps it whole.
    ``keep`` defaults to 2, and to 1 under Triton's interpreter, which has no timer to choose with. Returns the
    number of kernels cut."""
    global _LIMITED
    if _LIMITED or os.environ.get("DAYZERO_FLA_AUTOTUNE", "") == "full":
        return 0
    if keep is None:
        keep = 1 if os.environ.get("TRITON_INTERPRET") == "1" else 2
    _LIMITED, n = True, 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            for tuner in _autotuners(obj):
                if len(tuner.configs) > keep:
                    tuner.configs = _pick(list(tuner.configs), keep)
                    n += 1
    return n
