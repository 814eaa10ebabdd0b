"""Server logging: warnings and errors of one kind at most once a second.

A flood of bad clients (malformed requests, connections past the cap, timeouts) would otherwise write one
line each, and the log itself becomes the denial of service. A kind is the logger and the message's
format string; the first record of a kind is written, the others within the next second are counted,
and the next one written after that says how many were left out.
"""
from __future__ import annotations

import logging
import time


class OncePerSecond(logging.Filter):
    def __init__(self, interval: float = 1.0):
        super().__init__()
        self.interval = interval
        self._last: dict[tuple, tuple[float, int]] = {}  # kind -> (when last written, left out since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        kind = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        last, left_out = self._last.get(kind, (None, 0))
        if last is not None and now - last < self.interval:
            self._last[kind] = (last, left_out + 1)
            return False
        if len(self._last) > 10_000:  # kinds are format strings, so few; this only bounds a pathological logger
            self._last.clear()
        self._last[kind] = (now, 0)
        if left_out:
            record.msg = f"{record.getMessage()} ({left_out} more like it in the last {now - last:.0f}s not logged)"
            record.args = None
        return True


def install(logger: logging.Logger | None = None) -> None:
    """Put the filter on every handler of ``logger`` (the root logger by default), once."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, OncePerSecond) for f in handler.filters):
            handler.addFilter(OncePerSecond())
