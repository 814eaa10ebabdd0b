"""What one client may ask of the server, and how many requests it takes in at once.

Each limit is a command-line setting; going over one is a client error with a message that names the
limit and its value (400; 413 for the body size, 429 when the queue is full, 503 while shutting down).
"""
from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from dayzero.server.errors import APIError, bad_request


@dataclass(frozen=True)
class ServerLimits:
    max_body_bytes: int = 4 << 20
    max_concurrent_requests: int = 256  # generation requests handed to the engine at once
    max_queue_len: int = 1024  # requests waiting for one of those places; one more gets a 429
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_sequences: int = 16
    max_stop_length: int = 256  # characters per stop string
    max_stop_token_ids: int = 64
    max_prompts: int = 64  # prompts in one completions request (a list of prompts)
    max_messages: int = 4096  # messages in one chat request
    # characters of prompt text (a prompt string, or all message contents) checked before any templating or
    # tokenization; None: as many as could fit in the context (see ServerState.max_prompt_chars)
    max_prompt_chars: int | None = None
    max_stream_backlog: int = 1024  # tokens per output a client may leave unread before its request is aborted
    # the HTTP layer (dayzero.server.http)
    max_connections: int = 2048
    timeout_header: float = 10.0  # seconds to send a request's head, from connecting or from the last response
    timeout_body: float = 60.0  # seconds to send its body; also the longest a response may stall unread
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open

    def __post_init__(self):
        for name, value in vars(self).items():
            if name == "max_prompt_chars" and value is None:
                continue
            if name.startswith("timeout_") and name != "timeout_keep_alive":
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
                continue
            least = 0 if name in ("max_queue_len", "max_logprobs") else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")

    def check_n(self, n: int) -> None:
        if n > self.max_n:
            raise bad_request(f"n must be <= {self.max_n} (the server's limit), got {n}", "n")

    def check_logprobs(self, name: str, value: int | None) -> None:
        if value is not None and value > self.max_logprobs:
            raise bad_request(f"{name} must be <= {self.max_logprobs} (the server's limit), got {value}", name)

    def check_stop(self, stop, stop_token_ids=None) -> None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > self.max_stop_sequences:
            raise bad_request(f"stop has {len(stops)} sequences, the limit is {self.max_stop_sequences}", "stop")
        for s in stops:
            if isinstance(s, str) and len(s) > self.max_stop_length:
                raise bad_request(f"stop sequences must be at most {self.max_stop_length} characters, got one of {len(s)}", "stop")
        if stop_token_ids is not None and len(stop_token_ids) > self.max_stop_token_ids:
            raise bad_request(f"stop_token_ids has {len(stop_token_ids)} ids, the limit is {self.max_stop_token_ids}",
                              "stop_token_ids")


class Admission:
    """At most ``max_running`` requests in the engine, at most ``max_queued`` waiting for a place.

    ``acquire`` hands places out first come, first served; ``release`` passes a freed place straight to
    the oldest waiter. Lives on the event loop: no locks needed.
    """

    def __init__(self, max_running: int, max_queued: int):
        self.max_running, self.max_queued = max_running, max_queued
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.closed = False

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        if self.closed:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise APIError(
                429, f"the server is at capacity: {self.running} requests running (limit {self.max_running}) and "
                f"{len(self._waiters)} queued (limit {self.max_queued}); retry later", code="queue_full",
            )
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # the place was handed to us just as we were cancelled: pass it on
            elif fut in self._waiters:
                self._waiters.remove(fut)
            raise

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the place moves to this waiter; running stays the same
                return
        self.running -= 1

    def close(self) -> None:
        """Refuse new requests; wake the queued ones, which then fail with a 503."""
        self.closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.set_exception(APIError(503, "the server is shutting down", code="shutting_down"))
        self._waiters.clear()


# Python refuses to turn longer digit strings into ints (a denial-of-service guard); so do we, as a 400
MAX_INT_DIGITS = 4300
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


class OutOfRange:
    """An integer of the body outside the 64-bit range. It takes the integer's place, so that the field
    holding it, whichever it is, fails validation with its name (see ``protocol.parse``)."""

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


class _TooManyDigits(Exception):
    pass


def _parse_int(text: str):
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _TooManyDigits(digits)  # before int(), which would refuse it with a ValueError
    value = int(text)
    return value if _INT64_MIN <= value <= _INT64_MAX else OutOfRange(digits)


async def read_json_body(request: Request, max_bytes: int) -> dict:
    """The request body as a JSON object, or the 413 or 400 that says why not."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise bad_request(f"Content-Type must be application/json, got {ctype or 'none'!r}", code="unsupported_media_type")
    too_big = APIError(413, f"request body is larger than the limit of {max_bytes} bytes", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_big
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body") from None
    try:
        body = json.loads(b"".join(chunks), parse_int=_parse_int)
    except _TooManyDigits as e:
        raise bad_request(f"request body holds an integer of {e.args[0]} digits; the limit is {MAX_INT_DIGITS} "
                          f"(and a field takes at most 64 bits)", code="invalid_json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body is not valid JSON: it is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {_json_kind(body)}", code="invalid_json")
    return body


def _json_kind(value) -> str:
    if value is None:
        return "null"
    return {str: "a string", list: "an array", bool: "a boolean"}.get(type(value), "a number")
