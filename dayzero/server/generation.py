"""What every generation request shares: the server's state, and one request's life from admission to log.

A :class:`Run` is one HTTP request. It waits for a place (``Admission``), hands its prompts to the engine
thread in one command (one engine request per prompt, all with the same sampling parameters, added all
together or not at all), watches the connection so that a client who goes away aborts it at once, and
when it ends releases its place and records its metrics and one log line. ``close`` is idempotent and is
reached from every path out: normal end, error, cancellation, disconnect, a reader too far behind.

Templating and tokenization run on one worker thread of their own, never on the event loop: a large chat
history takes seconds to template, and ``/health`` and every stream must keep moving meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from starlette.requests import Request

from dayzero.engine.request import RequestOutput
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.tokenizer import chat_end_of_turn_ids
from dayzero.multimodal import content
from dayzero.multimodal.content import ImageRef, MediaPolicy
from dayzero.server.async_engine import AsyncEngine, Ended, PromptRefused
from dayzero.server.detokenize import Choice, TokenText
from dayzero.server.errors import APIError, bad_request, param_of
from dayzero.server.limits import Admission, ServerLimits
from dayzero.server.metrics import ServerMetrics
from dayzero.server.protocol import model_not_found

log = logging.getLogger("dayzero.server")


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # None for token-id prompts
    images: list | None = None  # decoded images, one per placeholder token in ``ids``


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object | None  # the event loop's own copy (logprobs, echo): the engine thread decodes with its own
    model_name: str
    limits: ServerLimits
    admission: Admission
    metrics: ServerMetrics
    worker_tokenizer: object | None = None  # the worker thread's copy, for templating and encoding
    max_model_len: int = 0
    media: MediaPolicy = field(default_factory=MediaPolicy)
    takes_images: bool = False  # the model has a vision encoder
    created: int = field(default_factory=lambda: int(time.time()))
    runs: set = field(default_factory=set)

    def __post_init__(self):
        self.token_text = TokenText(self.tokenizer)
        if self.worker_tokenizer is None:
            self.worker_tokenizer = self.tokenizer
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="dayzero-tokenize")
        # reading, fetching and decoding images: apart from the tokenizer's thread, so a slow fetch delays no prompt
        self.media_worker = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix="dayzero-media")
        self.end_of_turn = chat_end_of_turn_ids(self.tokenizer)  # chat generation stops there too
        self.max_prompt_chars = self.limits.max_prompt_chars or self._chars_that_fit()

    def _chars_that_fit(self) -> int:
        """Characters of text past which a prompt cannot fit in the context, whatever it says: the context
        times the longest token, times 4 for normalisers that merge characters (NFC and the like)."""
        tok = self.tokenizer
        if tok is None or not self.max_model_len:
            return self.limits.max_body_bytes
        longest = max((len(p) for p in tok.convert_ids_to_tokens(list(range(len(tok)))) if p), default=1)
        return self.max_model_len * max(longest, 1) * 4

    def decode(self, ids: list[int]) -> str:
        """Output text as the engine decodes it (special tokens dropped); event loop only."""
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name, self.model_name)

    def check_chars(self, chars: int, param: str) -> None:
        """The cheap bound checked before any templating or tokenization."""
        if chars > self.max_prompt_chars:
            raise bad_request(f"{param} holds {chars} characters of text, the limit is {self.max_prompt_chars}"
                              + ("" if self.limits.max_prompt_chars else f" (more cannot fit in the context of "
                                 f"{self.max_model_len} tokens)"), param)

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on the tokenizer's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def encode(self, text: str, param: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        """Worker thread only."""
        if self.worker_tokenizer is None:
            raise bad_request("this model has no tokenizer: give the prompt as token ids", param)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry a lone surrogate ("\ud800"); no text can
            raise bad_request(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None
        return self.worker_tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def prompts(self, raw: list[str | list[int]]) -> list[Prompt]:
        if len(raw) > self.limits.max_prompts:
            raise bad_request(f"prompt holds {len(raw)} prompts, the limit is {self.limits.max_prompts}", "prompt")
        for i, p in enumerate(raw):  # what no prompt may be, before any prompt is tokenized
            if isinstance(p, str):
                self.check_chars(len(p), "prompt" if len(raw) == 1 else f"prompt[{i}]")
            if not p:
                raise bad_request("prompt is empty: at least one token is needed" if len(raw) == 1
                                  else f"prompt {i} is empty: at least one token is needed", "prompt")
        if all(not isinstance(p, str) for p in raw):
            return [Prompt(p, None) for p in raw]
        return await self.off_loop(lambda: [Prompt(self.encode(p), p) if isinstance(p, str) else Prompt(p, None)
                                            for p in raw])

    async def images(self, refs: list[ImageRef]) -> list | None:
        """The request's images, decoded, or the 400 that refuses them: a model without a vision encoder refuses
        them unread (no file read, no fetch, no decode); otherwise the count and every URL are checked before
        anything is read, then they are read and decoded off the event loop."""
        if not refs:
            return None
        self.metrics.images_received.inc(len(refs))
        if not self.takes_images:
            self.metrics.images_rejected.labels("no_vision_encoder").inc(len(refs))
            raise bad_request(f"{refs[0].param}: this model has no vision encoder, so image content is not supported",
                              refs[0].param, code="image_input_not_supported")
        try:
            content.check_count(refs, self.media)
            sources = [content.resolve(r, self.media) for r in refs]
            loop = asyncio.get_running_loop()
            images = await asyncio.gather(*(loop.run_in_executor(self.media_worker, _load, s, self.media)
                                            for s in sources), return_exceptions=True)
            for image in images:  # the first bad image in message order is the one reported
                if isinstance(image, BaseException):
                    raise image
        except content.MediaError as e:
            self.metrics.images_rejected.labels(e.reason).inc()
            raise APIError(_MEDIA_STATUS.get(e.reason, 400), str(e), e.param, "invalid_image") from None
        return images

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)
        self.media_worker.shutdown(wait=False, cancel_futures=True)


MEDIA_THREADS = 4
# an image the server could not fetch is no fault of the request's form (RELIABILITY.md: 422)
_MEDIA_STATUS = {"fetch_failed": 422}


def _load(src: content.Source, policy: MediaPolicy):
    """Media thread: one checked source, read and decoded."""
    return content.decode(content.read_source(src, policy), src.param, policy.limits)


class Run:
    def __init__(self, srv: ServerState, http: Request, request_id: str, prompts: list[Prompt], params: SamplingParams,
                 arrival: float):
        self.srv, self.http, self.id = srv, http, request_id
        self.prompts, self.params, self.arrival = prompts, params, arrival
        self.engine_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        self.tokens: dict[tuple[int, int], int] = {}  # tokens generated per (prompt, output)
        self.reasons: dict[tuple[int, int], str] = {}  # finish reason per (prompt, output)
        self.done: set[int] = set()
        self.first_token_at: float | None = None
        self.prompt_tokens = [len(p.ids) for p in prompts]  # the engine's own counts once it took the prompts
        self.error: APIError | None = None
        self.client_gone = False
        self.fell_behind = False
        # what the engine thread delivered and the consumer has not read yet; at most max_stream_backlog tokens
        # per output (a client that stops reading blocks its stream's writes, and this fills up)
        self._mailbox: deque[tuple[int, RequestOutput | Ended]] = deque()
        self._unread = 0
        self._wake = asyncio.Event()
        self._gone = threading.Event()  # set by close: the engine thread then adds nothing of this run
        self._admitted = self._submitted = self._closed = False
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        """Wait for a place, then hand the prompts to the engine; raises the 400/429/503 that refuses the
        request. A client that goes away while queued gives its place in the queue back at once."""
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
            self._submitted = True
            self.prompt_tokens = await self.srv.engine.add(
                [(rid, p.ids, p.text, p.images) for rid, p in zip(self.engine_ids, self.prompts)],
                self.params, self.deliver, self._gone)
        except PromptRefused as e:
            self._submitted = False  # nothing of it went in
            self.close()
            msg = str(e.error) if len(self.prompts) == 1 else f"prompt {e.index}: {e.error}"
            raise bad_request(msg, param_of(str(e.error)) or "prompt") from None
        except BaseException:
            place.cancel()  # no-op once done; Admission passes on a place handed over at the last moment
            self.close()
            raise

    def deliver(self, tag: int, item: RequestOutput | Ended) -> None:
        """An output from the engine thread (on the event loop). A reader that leaves more than
        ``max_stream_backlog`` tokens per output unread has its request aborted: what it holds is bounded."""
        if self._closed:
            return
        self._mailbox.append((tag, item))
        if isinstance(item, RequestOutput):
            self._unread += sum(len(o.token_ids) for o in item.outputs)
            per_output = self.srv.limits.max_stream_backlog
            if self._unread > per_output * len(self.prompts) * self.params.n:
                self.fell_behind = True
                self.error = APIError(
                    499, f"the client fell {self._unread} tokens behind its stream (the limit is {per_output} per "
                    f"output): request aborted", code="stream_backlog")
                self._mailbox.clear()
                self.close()  # which leaves the consumer only the error
        self._wake.set()

    async def updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Yields the outputs delivered since the last time (``(prompt index, delta)`` in order), until every
        prompt has finished. Raises the request's ``APIError`` when the server ended it early (shutdown,
        engine failure, a reader too far behind)."""
        while len(self.done) < len(self.prompts):
            if not self._mailbox:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._mailbox)
            self._mailbox.clear()
            self._unread = 0
            for tag, item in batch:
                if isinstance(item, Ended):
                    self.error = self.error or item.error
                    raise item.error
                for o in item.outputs:
                    if o.finish_reason == "error":
                        self.error = APIError(500, "the model produced NaN or infinite logits for this request",
                                              code="non_finite_logits")
                        raise self.error
                    key = (tag, o.index)
                    self.tokens[key] = self.tokens.get(key, 0) + len(o.token_ids)
                    if o.finish_reason is not None:
                        self.reasons[key] = o.finish_reason
                    if self.first_token_at is None and o.token_ids:
                        self.first_token_at = time.monotonic()
                if item.finished:
                    self.done.add(tag)
            yield batch

    async def finish(self) -> dict[tuple[int, int], Choice]:
        """Wait for every prompt's outputs (non-streamed requests), close the run, and return each choice
        whole, keyed by (prompt index, output index)."""
        choices: dict[tuple[int, int], Choice] = {}
        try:
            async for batch in self.updates():
                for tag, out in batch:
                    for o in out.outputs:
                        choices.setdefault((tag, o.index), Choice()).add(o)
        finally:
            self.close()
        return choices

    @property
    def num_output_tokens(self) -> int:
        return sum(self.tokens.values())

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
        self._gone.set()  # before the aborts: an add not yet applied will not be
        if len(self.done) < len(self.prompts):  # a consumer still reading hears that nothing more will come
            gone = APIError(499, "the client disconnected", code="client_disconnected")
            self._mailbox.append((-1, Ended(self.error or gone)))
            self._wake.set()
        for i, rid in enumerate(self.engine_ids):
            if i not in self.done:
                self.srv.engine.abort(rid)
        if self._admitted:
            self.srv.admission.release()
        self.srv.runs.discard(self)
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()
        if self._submitted:
            self._record()

    def _record(self) -> None:
        now = time.monotonic()
        n_out = self.num_output_tokens
        longest = max(self.tokens.values(), default=0)
        n_prompt = sum(self.prompt_tokens)
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        if self.fell_behind:
            outcome, why = "aborted", f"abort ({self.error.message})"
        elif self.client_gone and len(self.done) < len(self.prompts):
            outcome, why = "aborted", "abort (client disconnected)"
        elif self.error is not None:
            outcome, why = ("aborted" if self.error.status == 503 else "error"), f"error ({self.error.message})"
        else:
            outcome, why = "finished", ",".join(sorted(set(self.reasons.values())))
        self.srv.metrics.record(outcome, n_prompt, n_out, longest, ttft, now - self.arrival)
        log.info("%s: prompt %d tokens, output %d tokens, ttft %s, total %.3fs, finish %s", self.id, n_prompt, n_out,
                 "-" if ttft is None else f"{ttft:.3f}s", now - self.arrival, why)
