"""The HTTP/1.1 connection layer: uvicorn's h11 protocol with the timeouts and the connection cap that a
server open to many clients needs (uvicorn alone closes idle keep-alive connections, nothing else).

- A connection must send a whole request head within ``timeout_header`` seconds of opening, or of its last
  response: one that sends nothing is closed, one that sent part of a head gets a 408 and is closed.
- A request body must arrive within ``timeout_body`` seconds of its head (a 408 and close otherwise), and a
  response may not stay stalled on a client that reads nothing for longer than that (closed).
- At most ``max_connections`` connections. At the cap, a new connection closes an idle one to make room:
  the longest idle of those already served (keep-alive), else the oldest of those that have sent no
  request yet, once it had ``FRESH_GRACE`` seconds to send one (a real client sends its head at once; a
  burst of new connections must not push each other out before any could). When none can go, the new
  connection gets a 503 and is closed: refused cleanly, never left hanging.

Each refusal is logged as a warning, which the log filter of ``dayzero.server.logs`` keeps to one a second.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from dayzero.server.errors import error_body

log = logging.getLogger("dayzero.server")

FRESH_GRACE = 0.5  # seconds a new connection is safe from being pushed out, to send its first request
MAX_LINGERING = 512  # refused connections kept open for a moment so that their client reads the 503


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    timeout_header: float
    timeout_body: float


def _canned(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode() + body


class Connections:
    """What the connections of one server share: the limits, how many are open, and the idle ones (those
    that may be pushed out at the cap): served ones by how long they have been idle, new ones by age."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.open = 0
        self.served: OrderedDict[GuardedH11Protocol, None] = OrderedDict()
        self.fresh: OrderedDict[GuardedH11Protocol, float] = OrderedDict()  # -> when it connected
        self.lingering = 0  # refused connections waiting for their client to read the 503

    def protocol(self, **kw) -> GuardedH11Protocol:  # uvicorn's protocol factory
        return GuardedH11Protocol(connections=self, **kw)

    def forget(self, p: GuardedH11Protocol) -> None:
        self.served.pop(p, None)
        self.fresh.pop(p, None)

    def push_out(self, now: float) -> bool:
        """Close an idle connection to make room; False when none may go."""
        while self.served or (self.fresh and now - next(iter(self.fresh.values())) >= FRESH_GRACE):
            victim = (self.served.popitem(last=False) if self.served else self.fresh.popitem(last=False))[0]
            if victim._counted and not victim.transport.is_closing():
                victim._counted = False
                self.open -= 1
                victim._cancel_timers()
                victim.transport.close()
                return True
        return False


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, connections: Connections, **kw):
        super().__init__(*args, **kw)
        self.guard = connections
        self.limits = connections.limits
        self._timer: asyncio.TimerHandle | None = None  # the header or the body deadline
        self._stall: asyncio.TimerHandle | None = None  # a response that the client does not read
        self._counted = False  # counted in guard.open
        self._refused = False

    # --- connection life ------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        g = self.guard
        if g.open >= self.limits.max_connections and not g.push_out(self.loop.time()):
            self._refuse(transport)
            return
        super().connection_made(transport)
        g.open += 1
        self._counted = True
        g.fresh[self] = self.loop.time()
        self._set_timer(self.limits.timeout_header, self._header_timeout)

    def connection_lost(self, exc) -> None:
        self._cancel_timers()
        if self._refused:
            self.guard.lingering -= 1
            return
        self.guard.forget(self)
        if self._counted:
            self._counted = False
            self.guard.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read and dropped, so that closing does not reset the connection before our 503 is read
        cycle = self.cycle
        super().data_received(data)
        self._after_events(cycle)

    def eof_received(self):
        if self._refused:
            self.transport.close()
        return super().eof_received()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()  # may start a pipelined request
        if not self.transport.is_closing():
            if self.cycle is cycle:
                self._wait_for_head()
            else:
                self._after_events(cycle)

    # --- flow control: a response the client does not read -----------------------------------------
    def pause_writing(self) -> None:
        if self._refused:
            return
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.limits.timeout_body, self._stalled)

    def resume_writing(self) -> None:
        if self._refused:
            return
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if not self.transport.is_closing():
            self.transport.abort()  # what is buffered for a reader that reads nothing is dropped

    # --- states -------------------------------------------------------------------------------------
    def _after_events(self, before) -> None:
        """After h11 events: a new head means a request in progress (body deadline, or none if it came
        whole); a body that completed ends its deadline."""
        if self.cycle is not before and self.cycle is not None:
            self.guard.forget(self)
            self._set_timer(self.limits.timeout_body if self.cycle.more_body else None, self._body_timeout)
        elif self.cycle is not None and not self.cycle.more_body and self._timer is not None \
                and not self.cycle.response_complete:
            self._set_timer(None, None)

    def _wait_for_head(self) -> None:
        """After a response: idle on keep-alive, or sending its next request's head."""
        self.guard.served[self] = None
        self._set_timer(self.limits.timeout_header, self._header_timeout)

    def _set_timer(self, delay: float | None, callback) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay, callback) if delay is not None else None

    def _cancel_timers(self) -> None:
        for t in (self._timer, self._stall):
            if t is not None:
                t.cancel()
        self._timer = self._stall = None

    def _header_timeout(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a head came
            msg = f"request head not received within {self.limits.timeout_header:g}s"
            self.transport.write(_canned(408, "Request Timeout", msg, "request_timeout"))
        self.transport.close()

    def _body_timeout(self) -> None:
        self._timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if not cycle.response_started:
            msg = f"request body not received within {self.limits.timeout_body:g}s"
            self.transport.write(_canned(408, "Request Timeout", msg, "request_timeout"))
        cycle.disconnected = True  # the app reading the body sees the client gone; nothing more is sent
        cycle.message_event.set()
        self.transport.close()

    # --- the cap ------------------------------------------------------------------------------------
    def _refuse(self, transport) -> None:
        self._refused = True
        self.transport = transport
        g, n = self.guard, self.limits.max_connections
        log.warning("connection refused: %d connections open, none idle long enough to close (limit %d)", g.open, n)
        transport.write(_canned(503, "Service Unavailable", f"the server has {n} connections open, its limit; "
                                f"retry later", "too_many_connections"))
        g.lingering += 1
        if g.lingering > MAX_LINGERING or not transport.can_write_eof():  # a flood of refusals: no time to be polite
            transport.close()
            return
        transport.write_eof()  # the client reads the 503, then sees the end; we close once it has
        self._timer = self.loop.call_later(1.0, transport.close)
