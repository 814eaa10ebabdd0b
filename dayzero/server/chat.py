"""``POST /v1/chat/completions``: messages through the model's own chat template, ``n`` choices, streamed or not."""
from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dayzero.server.completions import SSE_HEADERS, guarded, sse
from dayzero.server.detokenize import ChoiceDeltas
from dayzero.server.errors import bad_request
from dayzero.server.generation import Prompt, Run, ServerState
from dayzero.server.protocol import (
    ChatCompletionRequest, chat_logprobs, check_unsupported, parse, parse_messages, sampling_params, usage,
)



def _validate(srv: ServerState, req: ChatCompletionRequest) -> None:
    srv.check_model(req.model)
    check_unsupported(req)
    srv.limits.check_n(1 if req.n is None else req.n)
    if req.top_logprobs is not None:
        if req.top_logprobs < 0:
            raise bad_request(f"top_logprobs must be an int >= 0 or null, got {req.top_logprobs}", "top_logprobs")
        srv.limits.check_logprobs("top_logprobs", req.top_logprobs)
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.tools:
        raise bad_request("tools are not supported by this server", "tools")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise bad_request("response_format: only {'type': 'text'} is supported", "response_format")
    srv.limits.check_stop(req.stop)


def _chat_prompt(srv: ServerState, messages: list[dict]) -> Prompt:
    tok = srv.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template itself refuses (e.g. roles out of order): the client's to fix
        raise bad_request(f"messages do not fit the model's chat template: {e}", "messages") from None
    return Prompt(srv.encode(text, "messages"), text)


async def create_chat_completion(srv: ServerState, http: Request, body: dict, arrival: float) -> Response:
    req = parse(ChatCompletionRequest, body)
    _validate(srv, req)
    messages = parse_messages(req.messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    prompt = _chat_prompt(srv, messages)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = Run(srv, http, rid, [prompt], params, arrival)
    await run.start()
    head = {"id": rid, "created": int(time.time()), "model": srv.model_name}
    if req.stream:
        return StreamingResponse(guarded(run, _stream(srv, run, head, params.n, req.include_usage)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    await run.finish()
    outs = run.outputs[0].outputs
    choices = [{
        "index": o.index, "message": {"role": "assistant", "content": o.text},
        "logprobs": chat_logprobs(o.token_ids, o.logprobs, srv.token_text, o.top_logprobs) if o.logprobs is not None else None,
        "finish_reason": o.finish_reason,
    } for o in outs]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": usage(len(prompt.ids), sum(len(o.token_ids) for o in outs))})


async def _stream(srv: ServerState, run: Run, head: dict, n: int, include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if include_usage else {}
    deltas = ChoiceDeltas(n, run.params.stop)
    yield "".join(sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage_field})
                  for j in range(n))
    async for changed in run.updates():
        events = []
        for d in deltas(changed):
            lps = chat_logprobs(d.token_ids, d.logprobs, srv.token_text, d.top_logprobs) if d.logprobs is not None else None
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": d.choice, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
            events.append(sse({**head, "choices": [choice], **usage_field}))
        if events:
            yield "".join(events)
    if include_usage:
        outs = run.outputs[0].outputs
        yield sse({**head, "choices": [], "usage": usage(len(run.prompts[0].ids), sum(len(o.token_ids) for o in outs))})
