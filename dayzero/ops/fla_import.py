"""Importing fla-core (optional: fla's Triton kernels for KDA and the training forward's fused ops)."""
from __future__ import annotations

import contextlib
import warnings


@contextlib.contextmanager
def quiet_fla_import():
    """Around an import of fla-core: without a GPU it warns at import that it "rolls back to CPU", which tells our
    users nothing (its kernels run on CUDA tensors only, and on the CPU through the interpreter in the tests)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Triton is not supported on current platform")
        yield
