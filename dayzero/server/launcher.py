"""``dayzero serve``: load the model, print what is being served, run uvicorn until a signal, drain, exit 0."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import resource
import signal
import sys
import threading
import time

import torch
import uvicorn

from dayzero.engine.engine import DEFAULT_MODEL, EngineConfig, LLMEngine
from dayzero.engine.launch import start_engine, torchrun_rank
from dayzero.engine.workers import EngineDriver
from dayzero.server import logs
from dayzero.server.app import build_app
from dayzero.server.async_engine import AsyncEngine
from dayzero.server.http import MAX_LINGERING, ConnectionLimits, Connections
from dayzero.multimodal.content import MediaPolicy
from dayzero.multimodal.image import ImageLimits
from dayzero.server.limits import ServerLimits

log = logging.getLogger("dayzero.server")

# every ServerLimits field is the setting of the same name (``--max-n`` is ``max_n``); one the command line
# does not offer keeps its default
LIMIT_ARGS = tuple(f.name for f in dataclasses.fields(ServerLimits))
FD_RESERVE = 256  # descriptors kept for everything but client connections (weights, logs, pipes, threads)
H11_MAX_HEAD_BYTES = 16 << 10  # a larger request head is refused with a 400 (h11's own default, stated)


def server_limits(args) -> ServerLimits:
    return ServerLimits(**{k: getattr(args, k) for k in LIMIT_ARGS if getattr(args, k, None) is not None})


def media_policy(args) -> MediaPolicy:
    """Images per request, bytes and pixels per image, and where images may come from; a setting the command
    line does not offer keeps its default."""
    d, lim = MediaPolicy(), ImageLimits()

    def arg(name, default):
        value = getattr(args, name, None)
        return default if value is None else value

    return MediaPolicy(max_images=arg("limit_mm_per_prompt", d.max_images),
                       limits=ImageLimits(arg("max_image_bytes", lim.max_bytes), arg("max_image_pixels", lim.max_pixels)),
                       allowed_local_media_path=arg("allowed_local_media_path", None),
                       allow_remote_media=bool(arg("allow_remote_media", False)),
                       fetch_timeout=arg("media_fetch_timeout", d.fetch_timeout))


def _connection_cap(wanted: int) -> int:
    """``wanted`` connections, raising the soft limit on open files towards the hard one to make room;
    fewer, with a warning, when even the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + MAX_LINGERING + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < need:
        cap = max(1, soft - MAX_LINGERING - FD_RESERVE)
        log.warning("max_connections lowered from %d to %d: the limit on open files is %d (ulimit -n)", wanted, cap, soft)
        return cap
    return wanted


def uvicorn_config(app, host: str, port: int, limits: ServerLimits, shutdown_timeout: float) -> uvicorn.Config:
    """uvicorn on our h11 protocol (header and body timeouts, the connection cap) with its keep-alive timeout."""
    connections = Connections(ConnectionLimits(_connection_cap(limits.max_connections), limits.timeout_header,
                                               limits.timeout_body))
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, http=connections.protocol,
                          timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=limits.timeout_keep_alive,
                          h11_max_incomplete_event_size=H11_MAX_HEAD_BYTES)


class _Server(uvicorn.Server):
    """uvicorn's server with two changes. The first SIGTERM/SIGINT also starts draining the app. And the
    signal is not raised again once the server has stopped (uvicorn does, so that the process would end
    by the signal): a drained server exits with status 0."""

    def __init__(self, config: uvicorn.Config, on_signal):
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            self.on_signal()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class _Lost:
    """Called with the reason when the engine is lost for good (a rank of a multi-process engine died): stops
    the server, which then exits with status 1."""

    def __init__(self):
        self.reason: str | None = None
        self._servers: list[uvicorn.Server] = []

    def __call__(self, reason: str) -> None:
        self.reason = self.reason or reason
        for s in self._servers:
            s.should_exit = True

    def stops(self, server: uvicorn.Server) -> None:
        self._servers.append(server)
        server.should_exit = self.reason is not None  # lost before the server existed


def _platform(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(engine.device)}), torch {torch.__version__}"
    return f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}"


def serve(args) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("dayzero.server", "uvicorn"):
        logging.getLogger(name).setLevel(logging.INFO)
    logs.install()
    try:
        limits = server_limits(args)
        media = media_policy(args)
        config = EngineConfig(**args.engine_config)  # every engine option of the command (dayzero.tools.cli_options)
        if args.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
        if (torchrun_rank() or 0) > 0:  # another rank of a torchrun job: it serves rank 0's engine, not HTTP
            start_engine(config)  # returns only by ending the process
        t0 = time.perf_counter()
        lost = _Lost()
        async_engine = AsyncEngine(lambda: start_engine(config), lost)
    except (ValueError, RuntimeError, OSError) as e:  # bad setting, not enough memory, unreadable checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = async_engine.engine
    if isinstance(engine, EngineDriver):
        log.info("ranks: tp=%d, ep=%d, %d processes (rank 0 here; pids of the others: %s)", config.tp, config.ep,
                 len(engine.ranks) + 1, " ".join(map(str, engine.pids)) or "on other hosts")
        # a rank died while nothing waited on it: end the requests (the engine thread) and the server, even if
        # a step is stuck in a collective that never notices (NCCL)
        engine.on_failure(lambda message: (async_engine.fail(message), lost(message)))
    name = args.served_model_name or ("dayzero-default" if engine.path == DEFAULT_MODEL else engine.path.resolve().name)
    plan = engine.cache_plan
    cfg = engine.model_config
    log.info("model %s (%s, %s, %d layers) loaded in %.1fs", name, engine.path, cfg.model_type, cfg.num_hidden_layers,
             time.perf_counter() - t0)
    log.info("dtype %s; cache %d tokens (%d blocks of %d) and %d state slots; context %d tokens; up to %d sequences "
             "at once; platform %s", str(engine.dtype).removeprefix("torch."), plan.capacity_tokens, plan.num_blocks - 1,
             plan.block_size, plan.num_slots, engine.max_model_len, engine.scheduler.max_num_seqs, _platform(engine))
    log.info("decode steps: %s", engine.decode_mode)
    log.info("prefill steps: %s", engine.prefill_mode)
    if plan.host_blocks or plan.host_snapshots:
        log.info("host cache tier: %d blocks (%d tokens) and %d state snapshots", plan.host_blocks,
                 plan.host_blocks * plan.block_size, plan.host_snapshots)

    api_key = args.api_key or os.environ.get("DAYZERO_API_KEY") or None
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    app = build_app(async_engine, name, limits, api_key, allowed_origins=getattr(args, "allowed_origins", None),
                    media=media)

    def on_signal():
        loop = app.state.loop
        loop.call_soon_threadsafe(lambda: app.state.tasks.add(loop.create_task(app.state.drain(args.shutdown_timeout))))

    server = _Server(uvicorn_config(app, args.host, args.port, limits, args.shutdown_timeout), on_signal)
    lost.stops(server)
    try:
        server.run()
    finally:
        engine.close()
    if lost.reason:
        print(f"error: {lost.reason}; the server stopped", file=sys.stderr)
        return 1
    if not server.started:
        print(f"error: the server did not start on {args.host}:{args.port}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
