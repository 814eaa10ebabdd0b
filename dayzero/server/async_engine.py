"""The engine on a thread of its own, fed from the asyncio event loop.

``LLMEngine`` is single-threaded, so exactly one thread touches it. That thread loops:

1. take every pending command (add, abort, abort all, stop), blocking only while the engine is idle;
2. run one engine step;
3. hand the step's outputs to their consumers on the event loop, in one callback.

Commands are applied between steps: requests that arrive while others decode all join the very next step
(continuous batching across HTTP requests), and an abort frees the request's blocks and state slot before
that step. One HTTP request's prompts are one command, checked together and added together or not at
all, so a multi-prompt request is admitted in one step, whole. Requests are added in delta form: each
output carries only that step's tokens and final text, so what crosses to the event loop per step is
proportional to the step, not to the outputs so far.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable

from dayzero.engine.engine import LLMEngine
from dayzero.engine.request import RequestOutput
from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.workers import RankFailure
from dayzero.server.errors import APIError

log = logging.getLogger("dayzero.server")


@dataclass
class Ended:
    """The server ended a request before the engine finished it (abort, shutdown, engine failure)."""

    error: APIError


class PromptRefused(Exception):
    """The engine refused prompt ``index`` of a request (its ``ValueError`` says why); none was added."""

    def __init__(self, index: int, error: ValueError):
        super().__init__(str(error))
        self.index, self.error = index, error


Deliver = Callable[[Any, "RequestOutput | Ended"], None]  # (the prompt's tag, what happened), on the event loop


@dataclass
class _Sink:
    deliver: Deliver
    tag: Any


_STOP = object()


class AsyncEngine:
    """Builds the engine on its own thread and runs it there.

    The engine is built on the thread that steps it because torch's CPU thread pool belongs to the thread
    that first runs an op: stepping on a thread other than the one that loaded the weights keeps a second
    pool, and on a small machine the two pools fight over the cores (steps measured 2.3x slower on two
    cores). ``build`` runs in the constructor, which returns once the engine is ready and raises what
    ``build`` raised.

    A multi-process engine that lost a rank (``RankFailure``, from a step or through :meth:`fail`) cannot go on:
    its requests end with an error, the thread stops and ``on_fatal(message)`` is called (the server exits).
    """

    def __init__(self, build: Callable[[], LLMEngine], on_fatal: Callable[[str], None] | None = None):
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self.num_steps = 0
        self.failure: str | None = None  # set when the engine thread died; /health reports it
        self._stopped = False  # the engine thread has ended (or is ending): no command will run any more
        self.engine: LLMEngine | None = None
        self.on_fatal = on_fatal
        built = threading.Event()
        build_error: list[BaseException] = []

        def main():
            try:
                self.engine = build()
                self.stats = self.engine.stats()  # a snapshot, replaced (never mutated) by the engine thread
            except BaseException as e:
                build_error.append(e)
                self._stopped = True
                return
            finally:
                built.set()
            self._run()

        self._thread = threading.Thread(target=main, name="dayzero-engine", daemon=True)
        self._thread.start()
        built.wait()
        if build_error:
            raise build_error[0]

    # --- event-loop side ---------------------------------------------------------------------------
    def start(self) -> None:
        """Attach to the running event loop; commands may be sent from then on."""
        self._loop = asyncio.get_running_loop()

    async def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left and end the engine thread."""
        self._commands.put((_STOP,))
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0fs", timeout)

    @property
    def alive(self) -> bool:
        return not self._stopped

    async def add(self, prompts: list[tuple[str, list[int], str | None, list | None]], params: SamplingParams,
                  deliver: Deliver, gone: threading.Event) -> list[int]:
        """Queue one HTTP request's prompts, ``(engine request id, token ids, text, images or None)`` each, all
        with ``params``; returns once the engine took them all, with each prompt's length in tokens as the engine
        counts it (an image's placeholder may stand for many). ``deliver(i, item)`` gets prompt ``i``'s outputs
        on the event loop. Raises ``PromptRefused`` for a prompt the engine refuses, and then none was added.

        ``gone`` is the caller's way out: once it is set, the engine thread adds nothing of this command, and
        aborts sent after setting it are applied after the add, if the add came first."""
        if not self.alive:
            raise APIError(503, f"the engine is not running: {self.failure or 'stopped'}", code="engine_dead")
        accepted = self._loop.create_future()
        self._commands.put(("add", prompts, params, deliver, gone, accepted))
        if self._stopped:  # the thread ended just now and may have drained the queue before our add
            self._refuse_pending()
        try:
            return await accepted
        except asyncio.CancelledError:
            gone.set()
            for rid, *_ in prompts:
                self.abort(rid)
            raise

    def abort(self, request_id: str, error: APIError | None = None) -> None:
        """Abort a request (no-op once it finished, or if it never came); its consumer gets ``Ended(error)``."""
        self._commands.put(("abort", request_id, error or APIError(499, "the request was aborted", code="aborted")))

    def abort_all(self, error: APIError) -> None:
        self._commands.put(("abort_all", error))

    def fail(self, message: str) -> None:
        """From any thread: the engine is lost (a rank died while idle); end everything as a failed step would."""
        self._commands.put(("fail", message))

    # --- engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                commands = [] if self.engine.has_unfinished() else [self._commands.get()]  # idle: wait
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if cmd[0] is _STOP:
                        self._end_all(APIError(503, "the server is shutting down", code="shutting_down"))
                        return
                    self._apply(cmd)
                if self.engine.has_unfinished():
                    self._step()
                self.stats = self.engine.stats()
        except BaseException as e:  # a bug, not a request's fault: fail everything, leave /health unhealthy
            fatal = isinstance(e, RankFailure)
            if fatal:
                log.error("%s", e)
            else:
                log.exception("engine thread failed")
            self.failure = f"{type(e).__name__}: {e}"
            self._end_all(APIError(500, f"the engine failed: {self.failure}", code="engine_failed"))
            if fatal and self.on_fatal is not None:
                self.on_fatal(str(e))
        finally:
            self._stopped = True
            self._refuse_pending()
            self.stats = self.engine.stats()

    def _refuse_pending(self) -> None:
        """Once the thread has ended: fail every add still queued, so that no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                error = APIError(503, f"the engine is not running: {self.failure or 'stopped'}", code="engine_dead")
                self._loop.call_soon_threadsafe(_settle, cmd[-1], error)

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            self._add(*cmd[1:])
        elif kind == "abort":
            _, rid, error = cmd
            self._end(rid, error)
        elif kind == "abort_all":
            self._end_all(cmd[1])
        elif kind == "fail":
            raise RankFailure(cmd[1])

    def _add(self, prompts, params: SamplingParams, deliver: Deliver, gone: threading.Event, accepted) -> None:
        if gone.is_set():  # the client left before its turn came: nothing of it enters the engine
            self._loop.call_soon_threadsafe(
                _settle, accepted, APIError(499, "the client disconnected", code="client_disconnected"))
            return
        for i, (rid, ids, _, _) in enumerate(prompts):
            try:
                if rid in self._sinks or rid in self.engine.requests:
                    raise ValueError(f"request id {rid!r} is already in use")
                self.engine.check_request(ids, params)
            except ValueError as e:
                self._loop.call_soon_threadsafe(_settle, accepted, PromptRefused(i, e))
                return
        added, lengths = [], []
        try:
            for rid, ids, text, images in prompts:
                media = {"images": images} if images else {}  # text prompts call the engine as they always did
                self.engine.add_request(rid, ids, params, prompt=text, delta=True, **media)
                added.append(rid)
                lengths.append(self._prompt_tokens(rid, ids))
        except Exception as e:  # take back what went in; images the engine refuses are the client's to fix
            for rid in added:
                self.engine.abort(rid)
            refused = isinstance(e, ValueError) and bool(prompts[len(added)][3])
            self._loop.call_soon_threadsafe(_settle, accepted, PromptRefused(len(added), e) if refused else e)
            return
        for i, rid in enumerate(added):
            self._sinks[rid] = _Sink(deliver, i)
        self._loop.call_soon_threadsafe(_settle, accepted, None, lengths)

    def _prompt_tokens(self, rid: str, ids: list[int]) -> int:
        seqs = self.engine.requests.get(rid)
        return seqs[0].num_prompt_tokens if seqs else len(ids)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except RankFailure:
            raise  # the engine is gone, not just this step
        except Exception as e:
            log.exception("engine step failed; ending the requests in it")
            self._end_all(APIError(500, f"the engine step failed: {type(e).__name__}: {e}", code="engine_error"))
            return
        self.num_steps += 1
        batch = []
        for out in outputs:
            sink = self._sinks.pop(out.request_id) if out.finished else self._sinks.get(out.request_id)
            if sink is not None:
                batch.append((sink, out))
        self.stats = self.engine.stats()  # before the outputs: a client that saw its end sees the cache freed
        if batch:  # one wake-up of the event loop per step, however many requests moved
            self._loop.call_soon_threadsafe(_deliver_all, batch)

    def _end(self, rid: str, error: APIError) -> None:
        sink = self._sinks.pop(rid, None)
        try:
            self.engine.abort(rid)
            self.stats = self.engine.stats()
        finally:  # a consumer hears that its request ended even when the engine fails to say more
            if sink is not None:
                self._loop.call_soon_threadsafe(_deliver_all, [(sink, Ended(error))])

    def _end_all(self, error: APIError) -> None:
        for rid in list(self._sinks):
            try:
                self._end(rid, error)
            except Exception:  # keep going: every consumer must hear that its request ended
                log.exception("abort of %s failed", rid)


def _deliver_all(batch: list[tuple[_Sink, RequestOutput | Ended]]) -> None:
    for sink, item in batch:
        try:
            sink.deliver(sink.tag, item)
        except Exception:  # one consumer's bug must not starve the others of their outputs
            log.exception("delivering an output failed")


def _settle(fut: asyncio.Future, error: BaseException | None, result=None) -> None:
    if fut.done():  # the caller gave up waiting (client gone); its abort is already queued
        return
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)
