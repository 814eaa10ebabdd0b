"""The driving side of a multi-process engine: rank 0's ``LLMEngine`` and a connection to every other rank.

Every rank holds the same engine and must run the same step sequence, so the driver mirrors every call that
changes scheduler or cache state. ``add_request`` and ``abort`` run on rank 0 at once and are queued; ``step``
sends the queue with the step (one message per step and rank, carrying rank 0's random-generator state too),
runs rank 0's step, then reads each rank's digest of its outputs, which must equal rank 0's. Attributes
(``requests``, ``tokenizer``, ``cache_plan``, ...) and the methods in ``READS`` read rank 0's engine alone; any
other engine method is refused, so that a new call that changes state cannot skip the other ranks unseen.

Under attention data parallelism (``dp > 1``) the ranks form ``dp`` replicas of ``tp`` consecutive ranks, and each
replica holds requests of its own: the driver gives a new request to the replica with the fewest unfinished ones
(checking it on rank 0 first, so a bad request is refused before any rank sees it), replays it to that replica's
ranks alone, and every step takes the outputs and counters of each other replica from its first rank, whose ranks'
digests must equal its own. A replica with nothing to run still steps, to serve the others' expert exchanges.

A rank that dies or fails ends the engine: the ranks could no longer run the same steps. The driver finds out
while it waits for replies (a spawned worker's process sentinel, a closed connection, a timeout), or from the
collective it is in (Gloo raises once a peer's connection closes), or, while idle, from a monitor thread that
watches the spawned processes. Then every call raises :class:`RankFailure`, naming the rank and how it ended.
"""
from __future__ import annotations

import contextlib
import hashlib
import signal
import threading
import time
import weakref
from collections import ChainMap
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace
from typing import Callable

import torch

from dayzero.distributed import destroy_parallel

MIRRORED = ("add_request", "abort")  # the calls a step message replays before the step
READS = ("check_request", "cache_usage", "expert_load")  # change nothing: rank 0 alone
STEP_TIMEOUT = 60.0  # seconds a rank may lag rank 0 at the end of a step (they meet in its collectives)
EXPLAIN_TIMEOUT = 5.0  # seconds to wait for the other ranks' news once rank 0 itself failed
STARTUP_TIMEOUT = 600.0  # seconds the other ranks may take to build their engines after rank 0 built its own
SETTLE = 1.0  # once one rank failed, seconds to wait for the others' news before naming the first failure


class RankFailure(RuntimeError):
    """A rank of a multi-process engine died or failed: the engine has stopped and must be started again."""


# --- what crosses the connections ----------------------------------------------------------------------
def rng_state(device: torch.device) -> bytes:
    """The default generator's state on ``device``: what sampling without a per-request seed draws from."""
    t = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    return t.numpy().tobytes()  # bytes, not a tensor: torch would pickle a tensor through shared memory


def set_rng_state(device: torch.device, state: bytes, replica: int = 0) -> None:
    """Rank 0's generator state on ``device``; for another attention data-parallel replica, a state drawn from it
    and the replica's index, so that replicas' rows at the same batch position do not sample alike (the same prompt
    on two replicas would give the same tokens) while a replica's ranks still agree."""
    if replica:
        seed = int.from_bytes(hashlib.blake2b(state + replica.to_bytes(4, "little"), digest_size=8).digest(), "little")
        gen = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else torch.default_generator
        gen.manual_seed(seed)
        return
    t = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    torch.cuda.set_rng_state(t, device) if device.type == "cuda" else torch.set_rng_state(t)


def digest(outputs) -> list[tuple]:
    """What a step decided, small enough to send every step: per output, its request, whether it finished,
    and per sequence its token count, last tokens and finish reason."""
    return [(o.request_id, o.finished, [(c.index, len(c.token_ids), tuple(c.token_ids[-2:]), c.finish_reason)
                                        for c in o.outputs]) for o in outputs]


def plan_of(engine) -> tuple:
    """The cache and scheduler sizes every rank must share."""
    p = engine.cache_plan
    return (p.num_blocks, p.num_slots, p.num_snapshots, p.host_blocks, p.host_snapshots,
            engine.scheduler.max_num_seqs, engine.max_model_len)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: " + " ".join(str(e).split())


# --- one other rank ------------------------------------------------------------------------------------
class Rank:
    """The driver's end of one other rank: its connection, and its process when this host started it."""

    def __init__(self, rank: int, conn: Connection, process=None):
        self.rank, self.conn, self.process = rank, conn, process

    @property
    def waitables(self) -> list:
        return [self.conn] + ([self.process.sentinel] if self.process is not None else [])

    def receive(self) -> tuple:
        """The rank's next message; ``("died", how)`` once its end is closed."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return ("died", self.ended())

    def ended(self) -> str:
        if self.process is None:
            return f"rank {self.rank}'s connection closed (its process ended: see its log)"
        deadline = time.monotonic() + 2.0
        while self.process.exitcode is None and time.monotonic() < deadline:  # the monitor may be reaping it
            self.process.join(0.05)
        code = self.process.exitcode
        if code is None:
            return f"rank {self.rank} (pid {self.process.pid}) closed its connection"
        how = f"exit code {code}"
        if code < 0:
            with contextlib.suppress(ValueError):
                how += f" ({signal.Signals(-code).name})"
        return f"rank {self.rank} (pid {self.process.pid}) died with {how}"

    def stop(self, grace: float) -> None:
        """Ask the rank to leave, wait ``grace`` seconds for it, then kill it."""
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(("close",))
        if self.process is not None:
            self.process.join(grace)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(2.0)
        self.conn.close()


@dataclass
class _Life:
    """What the driver, its monitor thread and its finalizer share (none of them holds the driver itself)."""

    ranks: list[Rank]
    stopping: bool = False  # the driver itself is ending the ranks: their exits are no failure
    lost: str | None = None  # a spawned rank the monitor saw die
    listeners: list[Callable[[str], None]] = field(default_factory=list)


def _shutdown(life: _Life, grace: float = 5.0) -> None:
    life.stopping = True
    for r in life.ranks:
        r.stop(grace)
    with contextlib.suppress(Exception):  # also at interpreter exit, where the group may be half torn down
        destroy_parallel()


def _monitor(life: _Life) -> None:
    """Wait for a spawned rank's process to end; unless the driver is ending them, tell the listeners."""
    sentinels = {r.process.sentinel: r for r in life.ranks if r.process is not None}
    ended = wait(list(sentinels))
    if life.stopping:
        return
    life.lost = sentinels[ended[0]].ended()
    for listener in list(life.listeners):
        listener(f"the engine stopped: {life.lost}")


# --- the driver ----------------------------------------------------------------------------------------
class EngineDriver:
    """Rank 0's engine (reads go to it) with its calls mirrored to the other ranks. Built by
    :func:`dayzero.engine.launch.start_engine`, which starts the ranks and calls :meth:`start`."""

    def __init__(self, ranks: list[Rank]):
        self.engine = None
        self.ranks = ranks
        self.failure: str | None = None
        self.num_steps = 0
        self._calls: list[tuple] = []  # (replica, call) mirrored since the last step
        self.home: dict[str, int] = {}  # attention data parallelism: each unfinished request's replica
        self._remote: dict[str, list] = {}  # ... and, for those outside replica 0, what `requests` tells of them
        self._counters: dict[int, dict] = {}  # each other replica's LLMEngine.counters() after its last step
        self._life = _Life(ranks)
        self._finalizer = weakref.finalize(self, _shutdown, self._life)  # close(), garbage or interpreter exit

    def __getattr__(self, name):  # only for what the driver does not define: rank 0's engine answers
        if name == "engine":
            raise AttributeError(name)
        if callable(getattr(type(self.engine), name, None)) and name not in READS:
            raise AttributeError(f"LLMEngine.{name} is not mirrored to the other ranks (dayzero.engine.workers)")
        return getattr(self.engine, name)

    @property
    def pids(self) -> list[int]:
        return [r.process.pid for r in self.ranks if r.process is not None]

    # --- startup ------------------------------------------------------------------------------------
    def start(self, configs: list, join: Callable, build: Callable) -> None:
        """Give every rank its config, join the process group (``join()``, on a helper thread while the spawned
        ranks are watched), build rank 0's engine (``build(state)``, here), and wait for the others' engines."""
        for r, config in zip(self.ranks, configs):
            r.conn.send(("build", config))
        state = self._while_watched(join)
        try:
            self.engine = build(state)
        except Exception as e:
            if isinstance(e, ValueError):  # a setting rank 0 refused: every rank refuses it alike
                raise
            self._collect("startup", EXPLAIN_TIMEOUT, local=e)  # raises, naming the rank that failed first
            raise
        mine = plan_of(self.engine)
        for r, plan in zip(self.ranks, self._collect("startup", STARTUP_TIMEOUT)):
            if plan != mine:
                raise self._fail(f"rank {r.rank} planned other cache sizes {plan} than rank 0 {mine}: give "
                                 "num_cache_blocks (or cache_memory_bytes) to fix them")
        if self.pids:
            threading.Thread(target=_monitor, args=(self._life,), name="dayzero-ranks", daemon=True).start()

    def _while_watched(self, join: Callable):
        """``join()`` on a helper thread: a rank that dies before it joins would keep the rendezvous waiting
        for the process group's timeout (half an hour), so its death is reported at once instead."""
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(_run(join)), name="dayzero-join", daemon=True)
        t.start()
        sentinels = [r.process.sentinel for r in self.ranks if r.process is not None]
        while t.is_alive():
            if wait(sentinels, 0.2):
                self._collect("startup", EXPLAIN_TIMEOUT)  # raises with the rank's last words or its exit code
        if "error" in box:
            raise box["error"]
        return box["value"]

    # --- reads ---------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Attention data-parallel replicas (1 until rank 0's engine is built)."""
        return 1 if self.engine is None else self.engine.parallel.dp_size

    def _replica_loads(self) -> list[int]:
        """Each replica's unfinished requests."""
        homes = list(self.home.values())
        return [homes.count(d) for d in range(self.dp)]

    def _least_loaded(self) -> int:
        """The replica for a new request: the least cache its unfinished requests may still claim (each sample's
        prompt and token allowance), then the fewest requests, then the lowest index."""
        work = [0] * self.dp
        for rid, d in self.home.items():
            work[d] += sum(s.num_prompt_tokens + s.max_tokens for s in self.requests[rid])
        count = self._replica_loads()
        return min(range(self.dp), key=lambda d: (work[d], count[d], d))

    @property
    def requests(self):
        """Every unfinished request by id: rank 0's engine's, and under attention data parallelism the other
        replicas' (each a list of a stand-in per sample giving its prompt's token count and its max_tokens)."""
        return ChainMap(self.engine.requests, self._remote) if self.dp > 1 else self.engine.requests

    def has_unfinished(self) -> bool:
        return bool(self.home) or self.engine.has_unfinished()

    def stats(self) -> dict:
        """Rank 0's engine's stats; under attention data parallelism the counts (queues, cache, preemptions,
        aborts) are summed over the replicas (the others' as of their last step), and ``replica_requests`` counts
        each replica's unfinished requests."""
        out = self.engine.stats()
        if self.dp > 1:
            for counters in self._counters.values():
                for k, v in counters.items():
                    out[k] += v
            out["replica_requests"] = self._replica_loads()
        return out

    # --- mirrored calls -------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params, prompt: str | None = None,
                    delta: bool = False, images: list | None = None):
        self._check()
        d = 0
        if self.dp > 1:
            if request_id in self.home:
                raise ValueError(f"request id {request_id!r} is already in use")
            d = self._least_loaded()
        if d == 0:
            self.engine.add_request(request_id, prompt_token_ids, params, prompt=prompt, delta=delta, images=images)
        else:  # refused here as the replica would refuse it; its images are prepared again there
            ids, _ = self.engine.prepare_prompt(list(prompt_token_ids), list(images or []))
            max_tokens = self.engine.check_request(ids, params)  # a stand-in per sample, as the engine keeps
            self._remote[request_id] = [SimpleNamespace(num_prompt_tokens=len(ids), max_tokens=max_tokens)] * params.n
        if self.dp > 1:
            self.home[request_id] = d
        # every rank of the replica runs the tower on the same images (Pillow images and bytes pickle)
        self._calls.append((d, ("add_request", (request_id, list(prompt_token_ids), params),
                                {"delta": delta, "images": images})))

    def abort(self, request_id: str) -> bool:
        """Also after a failure (rank 0 alone then), so that callers can always clean up."""
        d = self.home.pop(request_id, 0)
        done = self._remote.pop(request_id, None) is not None if d else self.engine.abort(request_id)
        if done and self.failure is None:
            self._calls.append((d, ("abort", (request_id,), {})))
        return done

    def step(self):
        self._check()
        self.num_steps += 1
        what = f"step {self.num_steps}"
        calls, self._calls = self._calls, []
        rng = rng_state(self.engine.device)
        replica = self.engine.parallel.replica_of
        for r in self.ranks:
            try:
                r.conn.send(("step", [c for d, c in calls if d == replica(r.rank)], rng))
            except OSError:
                raise self._fail(r.ended()) from None
        try:
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._collect(what, EXPLAIN_TIMEOUT, local=e)  # raises, naming the rank that failed first
                raise
            replies = self._collect(what, STEP_TIMEOUT)
        except BaseException:  # also Ctrl-C: a step left half done here cannot be brought back in step
            self._fail(f"rank 0 was interrupted in {what}")  # nothing new when a failure is already recorded
            raise
        first = {0: (0, digest(outputs))}  # replica -> (its first rank, that rank's digest)
        for r, (theirs, led) in zip(self.ranks, replies):
            lead, want = first.setdefault(replica(r.rank), (r.rank, theirs))
            if theirs != want:
                raise self._fail(f"rank {r.rank} decided otherwise than rank {lead} in {what} "
                                 f"({theirs} against {want})")
            if led is not None:  # the first rank of another replica
                outputs += led[0]
                self._counters[replica(r.rank)] = led[1]
        for o in outputs if self.dp > 1 else ():
            if o.finished:
                self.home.pop(o.request_id, None)
                self._remote.pop(o.request_id, None)
        return outputs

    def on_failure(self, listener: Callable[[str], None]) -> None:
        """``listener(message)``, from a monitor thread, when a spawned rank dies while nothing waits on it."""
        self._life.listeners.append(listener)
        if self._life.lost is not None and not self._life.stopping:
            listener(f"the engine stopped: {self._life.lost}")

    def close(self) -> None:
        """Stop the other ranks and leave the process group (also on garbage collection and at exit)."""
        self.failure = self.failure or "the engine is closed"
        self._finalizer()

    # --- failure -----------------------------------------------------------------------------------------
    def _check(self) -> None:
        if self.failure is None and self._life.lost is not None:
            self._fail(self._life.lost)
        if self.failure is not None:
            raise RankFailure(self.failure)

    def _fail(self, what: str) -> RankFailure:
        """End the engine: remember why, stop the ranks, and return the error to raise."""
        if self.failure is None:
            self.failure = f"the engine stopped: {what}"
            _shutdown(self._life, grace=1.0)
        return RankFailure(self.failure)

    def _collect(self, what: str, timeout: float, local: Exception | None = None) -> list:
        """Every rank's reply to ``what``, or the :class:`RankFailure` that says which rank failed first: a
        rank that died without a word (its collectives then fail everywhere else), else a rank's own error,
        else rank 0's ``local`` error, else a rank that did not answer within ``timeout`` seconds."""
        news: dict[int, tuple] = {}
        pending = list(self.ranks)
        deadline = time.monotonic() + timeout
        while pending and (left := deadline - time.monotonic()) > 0:
            ready = set(wait([w for r in pending for w in r.waitables], left))
            for r in [r for r in pending if ready.intersection(r.waitables)]:
                news[r.rank] = r.receive()
                pending.remove(r)
                if news[r.rank][0] not in ("ready", "done"):
                    deadline = min(deadline, time.monotonic() + SETTLE)
        failed = sorted((m[0] != "died", rank, m) for rank, m in news.items() if m[0] not in ("ready", "done"))
        if failed:
            message = failed[0][2]
            if what == "startup" and message[0] == "error" and message[2]:
                self._fail(message[1])  # a setting a rank refused: still the ValueError that names it
                raise ValueError(message[1]) from local
            raise self._fail(message[1]) from local
        if local is not None:
            raise self._fail(f"rank 0 failed in {what}: {describe(local)}") from local
        if pending:
            raise self._fail(f"rank {pending[0].rank} did not answer {what} within {timeout:.0f}s")
        return [news[r.rank][1] for r in self.ranks]


def _run(fn: Callable) -> dict:
    try:
        return {"value": fn()}
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        return {"error": e}
