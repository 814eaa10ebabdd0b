"""What every generation request shares: the server's state, and one request's life from admission to log.

A :class:`Run` is one HTTP request. It waits for a place (``Admission``), hands its prompts to the engine
thread (one engine request per prompt, all with the same sampling parameters), watches the connection
so that a client who goes away aborts it at once, and when it ends releases its place and records its
metrics and one log line. ``close`` is idempotent and is reached from every path out: normal end,
error, cancellation, disconnect.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.requests import Request

from dayzero.engine.request import RequestOutput
from dayzero.engine.sampling_params import SamplingParams
from dayzero.server.async_engine import AsyncEngine, Ended
from dayzero.server.detokenize import TokenText
from dayzero.server.errors import APIError, bad_request, param_of
from dayzero.server.limits import Admission, ServerLimits
from dayzero.server.metrics import ServerMetrics
from dayzero.server.protocol import model_not_found

log = logging.getLogger("dayzero.server")


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # None for token-id prompts


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object | None  # the event loop's own copy: the engine thread decodes with the engine's
    model_name: str
    limits: ServerLimits
    admission: Admission
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    runs: set = field(default_factory=set)

    def __post_init__(self):
        self.token_text = TokenText(self.tokenizer)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    def encode(self, text: str, param: str = "prompt") -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry a lone surrogate ("\ud800"); no text can
            raise bad_request(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompts(self, raw: list[str | list[int]]) -> list[Prompt]:
        if len(raw) > self.limits.max_prompts:
            raise bad_request(f"prompt holds {len(raw)} prompts, the limit is {self.limits.max_prompts}", "prompt")
        return [Prompt(self.encode(p), p) if isinstance(p, str) else Prompt(p, None) for p in raw]


class Run:
    def __init__(self, srv: ServerState, http: Request, request_id: str, prompts: list[Prompt], params: SamplingParams,
                 arrival: float):
        self.srv, self.http, self.id = srv, http, request_id
        self.prompts, self.params, self.arrival = prompts, params, arrival
        self.engine_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self.outputs: dict[int, RequestOutput] = {}  # latest cumulative output per prompt
        self.done: set[int] = set()
        self.first_token_at: float | None = None
        self.error: APIError | None = None
        self.client_gone = False
        self._queue: asyncio.Queue = asyncio.Queue()
        self._admitted = self._started = self._closed = False
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Wait for a place, then queue the prompts; raises the 400/429/503 that refuses the request. A
        client that goes away while queued gives its place in the queue back at once."""
        self.srv.runs.add(self)
        self._watcher = asyncio.create_task(self._watch_disconnect())
        place = asyncio.ensure_future(self.srv.admission.acquire())
        try:
            await asyncio.wait([place, self._watcher], return_when=asyncio.FIRST_COMPLETED)
            if not place.done():
                raise APIError(499, "the client disconnected while queued", code="client_disconnected")
            place.result()  # the 429 or 503, if refused
            self._admitted = True
            if self._closed:  # the client left in the same instant
                self.srv.admission.release()
                raise APIError(499, "the client disconnected while queued", code="client_disconnected")
            for i, (rid, p) in enumerate(zip(self.engine_ids, self.prompts)):
                await self.srv.engine.add(rid, p.ids, self.params, p.text, self._queue, i)
                self._started = True
        except ValueError as e:
            self.close()
            raise bad_request(str(e) if len(self.prompts) == 1 else f"prompt {i}: {e}", param_of(str(e)) or "prompt") from None
        except BaseException:
            place.cancel()  # no-op once done; Admission passes on a place handed over at the last moment
            self.close()
            raise

    async def updates(self) -> AsyncIterator[dict[int, RequestOutput]]:
        """Yields ``{prompt index: latest output}`` for the prompts that moved, until all have finished.
        Raises the request's ``APIError`` when the server ended it early (shutdown, engine failure)."""
        while len(self.done) < len(self.prompts):
            batch = [await self._queue.get()]
            while not self._queue.empty():  # a slow reader skips to the latest snapshots
                batch.append(self._queue.get_nowait())
            changed: dict[int, RequestOutput] = {}
            for tag, item in batch:
                if isinstance(item, Ended):
                    self.error = item.error
                    raise item.error
                if any(o.finish_reason == "error" for o in item.outputs):
                    self.error = APIError(500, "the model produced NaN or infinite logits for this request",
                                          code="non_finite_logits")
                    raise self.error
                if self.first_token_at is None and any(o.token_ids for o in item.outputs):
                    self.first_token_at = time.monotonic()
                self.outputs[tag] = changed[tag] = item
                if item.finished:
                    self.done.add(tag)
            yield changed

    async def finish(self) -> None:
        """Wait for every prompt's output (non-streamed requests), then close the run."""
        try:
            async for _ in self.updates():
                pass
        finally:
            self.close()

    async def _watch_disconnect(self) -> None:
        while True:
            message = await self.http.receive()
            if message["type"] == "http.disconnect":
                self.client_gone = True
                self.close()
                return

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for i, rid in enumerate(self.engine_ids):
            if i not in self.done:
                self.srv.engine.abort(rid)
        if self._admitted:
            self.srv.admission.release()
        self.srv.runs.discard(self)
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if self._started:
            self._record()

    def _record(self) -> None:
        now = time.monotonic()
        outs = [o for r in self.outputs.values() for o in r.outputs]
        n_out = sum(len(o.token_ids) for o in outs)
        longest = max((len(o.token_ids) for o in outs), default=0)
        n_prompt = sum(len(p.ids) for p in self.prompts)
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        if self.client_gone and len(self.done) < len(self.prompts):
            outcome, why = "aborted", "abort (client disconnected)"
        elif self.error is not None:
            outcome, why = ("aborted" if self.error.status == 503 else "error"), f"error ({self.error.message})"
        else:
            outcome, why = "finished", ",".join(sorted({str(o.finish_reason) for o in outs}))
        self.srv.metrics.record(outcome, n_prompt, n_out, longest, ttft, now - self.arrival)
        log.info("%s: prompt %d tokens, output %d tokens, ttft %s, total %.3fs, finish %s", self.id, n_prompt, n_out,
                 "-" if ttft is None else f"{ttft:.3f}s", now - self.arrival, why)
