"""The one error path of the command line: a failure is one line, ``error: ...``, on stderr, and an exit status.

2: bad usage, something the user gives and can fix (an option, a missing or unreadable file, a config, a
checkpoint that disagrees with its config, ``DAYZERO_OPS``, settings that do not fit in memory).
1: a failure at run time. 130: interrupted (Ctrl-C). The traceback is shown only with -v / --debug.
"""
from __future__ import annotations

import sys
import traceback


def usage_errors() -> tuple[type[BaseException], ...]:
    from dayzero.cache.planner import CacheMemoryError
    from dayzero.loader.safetensors_loader import CheckpointError

    return (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, CheckpointError,
            CacheMemoryError)


def describe(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}"
    else:
        text = str(e) if str(e) else type(e).__name__
    return " ".join(line.strip() for line in text.strip().splitlines())


def run_command(func, args) -> int:
    """``func(args)``'s exit status; an exception becomes its one line and status."""
    verbose = getattr(args, "verbose", False) or getattr(args, "debug", False)
    try:
        return func(args)
    except KeyboardInterrupt:
        if verbose:
            traceback.print_exc()
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the command line's last word on any failure
        if verbose:
            traceback.print_exc()
        if isinstance(e, usage_errors()):
            print(f"error: {describe(e)}", file=sys.stderr)
            return 2
        hint = "" if verbose else " (run with -v for the traceback)"
        print(f"error: {type(e).__name__}: {describe(e)}{hint}", file=sys.stderr)
        return 1
