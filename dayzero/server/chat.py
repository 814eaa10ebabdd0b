"""``POST /v1/chat/completions``: messages through the model's own chat template, ``n`` choices, streamed or not.

Generation stops at the token the template closes an assistant turn with (``<|end|>``, ``<|im_end|>``, ...)
as it does at EOS. The chat template options vLLM accepts are honoured (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``, ``add_special_tokens``) or refused with a 400 naming
the field (``chat_template``, ``documents``). Cheap bounds (message count, characters, images) come first;
images are read and decoded on the media threads (:mod:`dayzero.multimodal.content`), templating and
tokenization on the worker thread.
"""
from __future__ import annotations

import inspect
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from dayzero.multimodal.content import text_chars
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
    srv.limits.check_stop(req.stop, req.stop_token_ids)
    if req.chat_template is not None:
        raise bad_request("chat_template is not accepted: this server renders the model's own chat template",
                          "chat_template")
    if req.documents is not None:
        raise bad_request("documents are not supported by this server", "documents")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message needs add_generation_prompt to be false: the last message is "
                          "continued, no new one started", "continue_final_message")


def _template_options(srv: ServerState, req: ChatCompletionRequest, messages: list[dict]) -> dict:
    options = {"add_generation_prompt": req.add_generation_prompt is not False,
               "continue_final_message": bool(req.continue_final_message)}
    if options["continue_final_message"] and messages[-1]["role"] != "assistant":
        raise bad_request(f"continue_final_message needs the last message to be the assistant's, got role "
                          f"{messages[-1]['role']!r}", "continue_final_message")
    for key in req.chat_template_kwargs or {}:
        if key in _reserved(srv.worker_tokenizer):
            raise bad_request(f"chat_template_kwargs: {key!r} is not a template variable but an option of the "
                              f"templating itself", "chat_template_kwargs")
    return {**(req.chat_template_kwargs or {}), **options}


def _reserved(tokenizer) -> set[str]:
    """Names a template variable may not take: the templating call's own parameters."""
    names = set(inspect.signature(tokenizer.apply_chat_template).parameters) if tokenizer is not None else set()
    return (names | {"messages", "conversation", "tokenize", "bos_token", "eos_token"}) - {"kwargs"}


def _chat_prompt(srv: ServerState, messages: list[dict], options: dict, add_special_tokens: bool,
                 images: list | None) -> Prompt:
    """Worker thread: the templated, tokenized conversation (each image part a placeholder the template writes)."""
    tok = srv.worker_tokenizer
    try:
        text = tok.apply_chat_template(messages, tokenize=False, **options)
    except Exception as e:  # the template itself refuses (e.g. roles out of order): the client's to fix
        raise bad_request(f"messages do not fit the model's chat template: {e}", "messages") from None
    return Prompt(srv.encode(text, "messages", add_special_tokens), text, images)


async def create_chat_completion(srv: ServerState, http: Request, body: dict, arrival: float) -> Response:
    req = parse(ChatCompletionRequest, body)
    _validate(srv, req)
    messages, image_refs = parse_messages(req.messages, srv.limits.max_messages)
    srv.check_chars(text_chars(messages), "messages")
    if srv.worker_tokenizer is None or not getattr(srv.worker_tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template: use /v1/completions", "messages")
    options = _template_options(srv, req, messages)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, srv.end_of_turn)
    images = await srv.images(image_refs)
    prompt = await srv.off_loop(_chat_prompt, srv, messages, options, bool(req.add_special_tokens), images)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    run = Run(srv, http, rid, [prompt], params, arrival)
    await run.start()
    head = {"id": rid, "created": int(time.time()), "model": srv.model_name}
    if req.stream:
        return StreamingResponse(guarded(run, _stream(srv, run, head, params.n, req.include_usage)), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    outputs = await run.finish()
    choices = [{
        "index": j, "message": {"role": "assistant", "content": o.text},
        "logprobs": chat_logprobs(o.token_ids, o.logprobs, srv.token_text, o.top_logprobs) if o.logprobs is not None else None,
        "finish_reason": o.finish_reason,
    } for (_, j), o in sorted(outputs.items())]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": usage(run.prompt_tokens[0], run.num_output_tokens)})


async def _stream(srv: ServerState, run: Run, head: dict, n: int, include_usage: bool):
    head = {**head, "object": "chat.completion.chunk"}
    usage_field = {"usage": None} if include_usage else {}
    deltas = ChoiceDeltas(n)
    yield "".join(sse({**head, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **usage_field})
                  for j in range(n))
    async for batch in run.updates():
        events = []
        for d in deltas(batch):
            lps = chat_logprobs(d.token_ids, d.logprobs, srv.token_text, d.top_logprobs) if d.logprobs is not None else None
            delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            choice = {"index": d.choice, "delta": delta, "logprobs": lps, "finish_reason": d.finish_reason}
            events.append(sse({**head, "choices": [choice], **usage_field}))
        if events:
            yield "".join(events)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(run.prompt_tokens[0], run.num_output_tokens)})
