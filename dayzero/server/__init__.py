"""The OpenAI-compatible HTTP server (``dayzero serve``).

``protocol`` (request schemas, response pieces) · ``async_engine`` (the engine on its own thread) ·
``generation`` (one request's life: admission, engine requests, disconnect watch, metrics, log line) ·
``completions`` / ``chat`` (the two endpoints) · ``detokenize`` (stream events and whole choices from the
engine's deltas, token text and offsets for logprobs) · ``limits`` · ``metrics`` · ``errors`` · ``app``
(FastAPI app) · ``http`` (connection timeouts and cap) · ``logs`` (errors once a second) · ``launcher``
(uvicorn, signals).
Importing this package loads nothing heavy; ``dayzero.server.app`` needs FastAPI.
"""
