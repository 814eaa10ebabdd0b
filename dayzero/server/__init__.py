"""The OpenAI-compatible HTTP server (``dayzero serve``).

``protocol`` (request schemas, response pieces) · ``async_engine`` (the engine on its own thread) ·
``generation`` (one request's life: admission, engine requests, disconnect watch, metrics, log line) ·
``completions`` / ``chat`` (the two endpoints) · ``detokenize`` (streamed text that never splits a
character) · ``limits`` · ``metrics`` · ``errors`` · ``app`` (FastAPI app) · ``launcher`` (uvicorn, signals).
Importing this package loads nothing heavy; ``dayzero.server.app`` needs FastAPI.
"""
