"""``POST /v1/completions``: one or more prompts (text or token ids), ``n`` choices each, streamed or not.

Choice ``i * n + j`` is output ``j`` of prompt ``i``, as in OpenAI's API.
"""
from __future__ import annotations

import json
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dayzero.server.detokenize import ChoiceDeltas, TextOffsets
from dayzero.server.errors import APIError, bad_request
from dayzero.server.generation import Prompt, Run, ServerState
from dayzero.server.protocol import (
    CompletionRequest, check_unsupported, completion_logprobs, parse, parse_prompt, sampling_params, usage,
)

log = logging.getLogger("dayzero.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def _validate(srv: ServerState, req: CompletionRequest) -> None:
    srv.check_model(req.model)
    check_unsupported(req)
    n = 1 if req.n is None else req.n
    srv.limits.check_n(n)
    if req.best_of is not None and req.best_of != n:
        raise bad_request(f"best_of is not supported (it may only equal n, {n}), got {req.best_of}", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.logprobs is not None:
        if req.logprobs < 0:
            raise bad_request(f"logprobs must be an int >= 0 or null, got {req.logprobs}", "logprobs")
        srv.limits.check_logprobs("logprobs", req.logprobs)
        if req.echo:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)", "echo")
    srv.limits.check_stop(req.stop, req.stop_token_ids)


async def create_completion(srv: ServerState, http: Request, body: dict, arrival: float) -> Response:
    req = parse(CompletionRequest, body)
    _validate(srv, req)
    params = sampling_params(req, req.max_tokens, req.logprobs)
    prompts = await srv.prompts(parse_prompt(req.prompt))
    rid = f"cmpl-{uuid.uuid4().hex}"
    run = Run(srv, http, rid, prompts, params, arrival)
    await run.start()
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": srv.model_name}
    echo = [_prompt_text(srv, p) for p in prompts] if req.echo else None
    if req.stream:
        return StreamingResponse(guarded(run, _stream(srv, run, head, params.n, echo, req.include_usage)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    outputs = await run.finish()
    choices = []
    for (i, j), o in sorted(outputs.items()):
        text = o.text
        lps = None
        if o.logprobs is not None:
            offsets = TextOffsets(srv.decode)(o.token_ids, text)
            lps = completion_logprobs(o.token_ids, o.logprobs, srv.token_text, offsets,
                                      o.top_logprobs if req.logprobs else None)
        choices.append({"index": i * params.n + j, "text": (echo[i] if echo else "") + text, "logprobs": lps,
                        "finish_reason": o.finish_reason})
    return JSONResponse({**head, "choices": choices,
                         "usage": usage(sum(run.prompt_tokens), run.num_output_tokens)})


def _prompt_text(srv: ServerState, p: Prompt) -> str:
    if p.text is not None:
        return p.text
    return srv.tokenizer.decode(p.ids) if srv.tokenizer is not None else ""


async def _stream(srv: ServerState, run: Run, head: dict, n: int, echo: list[str] | None, include_usage: bool):
    deltas = ChoiceDeltas(n)
    offsets: dict[int, TextOffsets] = {}  # per choice, for text_offset
    usage_field = {"usage": None} if include_usage else {}
    if echo:
        yield "".join(sse({**head, "choices": [{"index": i * n + j, "text": text, "logprobs": None,
                                               "finish_reason": None}], **usage_field})
                      for i, text in enumerate(echo) for j in range(n))
    async for batch in run.updates():
        events = []
        for d in deltas(batch):
            lps = None
            if d.logprobs is not None:
                where = offsets.setdefault(d.choice, TextOffsets(srv.decode))(d.token_ids, d.text)
                lps = completion_logprobs(d.token_ids, d.logprobs, srv.token_text, where,
                                          d.top_logprobs if run.params.logprobs else None)
            choice = {"index": d.choice, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}
            events.append(sse({**head, "choices": [choice], **usage_field}))
        if events:
            yield "".join(events)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(sum(run.prompt_tokens), run.num_output_tokens)})


async def guarded(run: Run, events):
    """An endpoint's SSE events, then ``[DONE]``: an error mid-stream becomes a final error event, a client
    that left gets nothing more, and the run is closed on every path."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        if run.client_gone:
            return
        yield sse(e.body())
    except Exception as e:  # a server bug: the client still gets a final error event and [DONE]
        log.exception("%s failed while streaming", run.id)
        yield sse(APIError(500, f"internal server error: {type(e).__name__}", code="internal_error").body())
    finally:
        run.close()
    yield DONE
