"""The FastAPI app: routes, the API-key check, CORS, errors in the OpenAI shape, start-up and draining.

Bodies are read and parsed by hand (size limit, content type, JSON object) rather than by FastAPI's body
models, so that every bad input gets a 400/413 in the OpenAI error shape instead of a 422.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from pathlib import Path

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from dayzero.engine.tokenizer import load_tokenizer
from dayzero.multimodal.content import MediaPolicy
from dayzero.server.async_engine import AsyncEngine
from dayzero.server.chat import create_chat_completion
from dayzero.server.completions import create_completion
from dayzero.server.errors import APIError, error_body
from dayzero.server.generation import ServerState
from dayzero.server.limits import Admission, ServerLimits, read_json_body
from dayzero.server.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("dayzero.server")


class APIKeyMiddleware:
    """Every route but ``/health`` needs ``Authorization: Bearer KEY``; compared in constant time."""

    def __init__(self, app, key: str, on_reject):
        self.app = app
        self.expected = f"Bearer {key}".encode()
        self.on_reject = on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return await self.app(scope, receive, send)
        self.on_reject(401)
        msg = "missing API key: send 'Authorization: Bearer <key>'" if not given else "invalid API key"
        await JSONResponse(error_body(401, msg, code="invalid_api_key"), 401,
                           headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)


def build_app(async_engine: AsyncEngine, model_name: str, limits: ServerLimits | None = None,
              api_key: str | None = None, allowed_origins: list[str] | None = None,
              media: MediaPolicy | None = None) -> FastAPI:
    """``allowed_origins``: origins a browser may call the API from (CORS; ``["*"]`` for any); none by default.
    ``media``: how many images a request may carry, how large, and from where (data URLs only by default)."""
    limits = limits or ServerLimits()
    engine = async_engine.engine
    admission = Admission(limits.max_concurrent_requests, limits.max_queue_len)
    metrics = ServerMetrics(lambda: async_engine.stats, lambda: admission.queued)
    # one tokenizer per thread: the engine thread decodes with engine.tokenizer, the event loop with one
    # (logprobs, echo) and the worker thread templates and encodes with another
    tokenizers = [load_tokenizer(engine.path) if engine.tokenizer is not None else None for _ in range(2)]
    srv = ServerState(async_engine, tokenizers[0], model_name, limits, admission, metrics,
                      worker_tokenizer=tokenizers[1], max_model_len=engine.max_model_len, media=media or MediaPolicy(),
                      takes_images=takes_images(engine.path))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()
        app.state.tasks = set()  # keeps the drain task referenced while it runs
        async_engine.start()
        yield
        admission.close()
        await async_engine.stop()
        srv.close()

    app = FastAPI(title="dayzero", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.srv = srv
    app.state.drain = lambda timeout: _drain(srv, timeout)
    if api_key:
        app.add_middleware(APIKeyMiddleware, key=api_key, on_reject=lambda status: metrics.errors.labels(str(status)).inc())
    if allowed_origins:  # added last, so outermost: a preflight (which carries no key) is answered here
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        metrics.errors.labels(str(e.status_code)).inc()
        if e.status_code == 404:
            msg = f"unknown route: {request.method} {request.url.path}"
        elif e.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(e.detail)
        return JSONResponse(error_body(e.status_code, msg), e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):  # a server bug: log it, say so, stay up
        log.exception("internal error on %s %s", request.method, request.url.path)
        metrics.errors.labels("500").inc()
        return JSONResponse(error_body(500, f"internal server error: {type(e).__name__}", code="internal_error"), 500)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not async_engine.alive:
            return JSONResponse({"status": "error", "error": async_engine.failure or "engine stopped"}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": srv.created, "owned_by": "dayzero",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        srv.check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        return await create_completion(srv, request, await read_json_body(request, limits.max_body_bytes), arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        return await create_chat_completion(srv, request, await read_json_body(request, limits.max_body_bytes), arrival)

    return app


def takes_images(path) -> bool:
    """Whether the checkpoint has a vision encoder (a ``vision_config`` in its ``config.json``). Images sent to
    any other model are refused before they reach the engine."""
    try:
        raw = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and bool(raw.get("vision_config"))


async def _drain(srv: ServerState, timeout: float) -> None:
    """Stop taking requests; let in-flight ones finish until shortly before ``timeout``, then end the
    rest with a 503 (a final error event in a stream), so that the process exits within the timeout."""
    srv.admission.close()
    left = len(srv.runs)
    log.info("shutting down: %d requests in flight, up to %.1fs to finish them", left, timeout)
    deadline = time.monotonic() + max(0.0, timeout - min(1.0, 0.2 * timeout))
    while srv.runs and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if srv.runs:
        log.warning("shutdown timeout: aborting %d requests still in flight", len(srv.runs))
        srv.engine.abort_all(APIError(503, "the server is shutting down", code="shutting_down"))

