"""``dayzero serve``: load the model, print what is being served, run uvicorn until a signal, drain, exit 0."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

import torch
import uvicorn

from dayzero.engine.engine import DEFAULT_MODEL, EngineConfig, LLMEngine
from dayzero.server.app import build_app
from dayzero.server.async_engine import AsyncEngine
from dayzero.server.limits import ServerLimits

log = logging.getLogger("dayzero.server")

LIMIT_ARGS = ("max_body_bytes", "max_concurrent_requests", "max_queue_len", "max_n", "max_logprobs",
              "max_stop_sequences", "max_stop_length", "max_prompts")


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


def _platform(engine: LLMEngine) -> str:
    if engine.device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(engine.device)}), torch {torch.__version__}"
    return f"cpu ({torch.get_num_threads()} threads), torch {torch.__version__}"


def serve(args) -> int:
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("dayzero.server", "uvicorn"):
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        limits = ServerLimits(**{k: getattr(args, k) for k in LIMIT_ARGS})
        config = EngineConfig(
            model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
            num_cache_blocks=args.num_cache_blocks, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len, seed=args.seed,
            enforce_eager=getattr(args, "enforce_eager", False), cuda_graph_sizes=getattr(args, "cuda_graph_sizes", None),
        )
        if args.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {args.shutdown_timeout}")
        t0 = time.perf_counter()
        async_engine = AsyncEngine(lambda: LLMEngine(config))
    except (ValueError, RuntimeError, OSError) as e:  # bad setting, not enough memory, unreadable checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2
    engine = async_engine.engine
    name = args.served_model_name or ("dayzero-default" if engine.path == DEFAULT_MODEL else engine.path.resolve().name)
    plan = engine.cache_plan
    cfg = engine.model_config
    log.info("model %s (%s, %s, %d layers) loaded in %.1fs", name, engine.path, cfg.model_type, cfg.num_hidden_layers,
             time.perf_counter() - t0)
    log.info("dtype %s; cache %d tokens (%d blocks of %d) and %d state slots; context %d tokens; up to %d sequences "
             "at once; platform %s", str(engine.dtype).removeprefix("torch."), plan.capacity_tokens, plan.num_blocks - 1,
             plan.block_size, plan.num_slots, engine.max_model_len, engine.scheduler.max_num_seqs, _platform(engine))
    log.info("decode steps: %s", engine.decode_mode)

    api_key = args.api_key or os.environ.get("DAYZERO_API_KEY") or None
    if api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without an API key: anyone who can reach it can use it", args.host)
    app = build_app(async_engine, name, limits, api_key)

    def on_signal():
        loop = app.state.loop
        loop.call_soon_threadsafe(lambda: app.state.tasks.add(loop.create_task(app.state.drain(args.shutdown_timeout))))

    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                               timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=5)
    server = _Server(uv_config, on_signal)
    server.run()
    if not server.started:
        print(f"error: the server did not start on {args.host}:{args.port}", file=sys.stderr)
        return 1
    log.info("stopped")
    return 0
