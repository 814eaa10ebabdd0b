"""OpenAI request schemas (pydantic, strict types) and the pieces of OpenAI responses.

Requests are validated in two layers: pydantic checks types (strict: ``"1"`` is not a number, ``true`` is
not an int), ``SamplingParams`` checks ranges and names the field. Prompts and messages are checked by
hand, so that the message says what shape was expected. Unknown fields are ignored, as clients send
vendor extensions; the engine's extra knobs use vLLM's names (``top_k``, ``min_p``, ``ignore_eos``, ...).
"""
from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from dayzero.engine.sampling_params import SamplingParams
from dayzero.engine.tokenizer import with_end_of_turn
from dayzero.multimodal import content
from dayzero.multimodal.content import ImageRef
from dayzero.server.errors import APIError, bad_request, param_of
from dayzero.server.limits import OutOfRange

ROLES = ("system", "developer", "user", "assistant", "tool")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _GenerationRequest(_Strict):
    model: str | None = None
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # engine knobs beyond OpenAI's
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: Any = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_GenerationRequest):
    messages: Any = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None
    # chat template options (vLLM's names): the first four are honoured, the last two refused
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = False
    chat_template: Any = None
    documents: Any = None


def parse(model: type[_Strict], body: dict) -> Any:
    """Validate a JSON body; the first type error becomes a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # drop the union-member tags pydantic puts in the location ("str", "list[str]", ...)
        loc = [p for p in err["loc"] if isinstance(p, int) or p in model.model_fields or p in StreamOptions.model_fields]
        param = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)) or None
        if isinstance(err.get("input"), OutOfRange):
            raise bad_request(f"{param} is out of range: got {err['input']}, and numbers given as integers must "
                              f"fit in 64 bits", param) from None
        got = repr(err.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise bad_request(f"{param}: {err['msg'].lower()}, got {got}", param) from None


def sampling_params(req: _GenerationRequest, max_tokens: int | None, logprobs: int | None,
                    end_of_turn: tuple[int, ...] = ()) -> SamplingParams:
    """``logprobs``: None for none, else how many top alternatives to return beside the chosen token's.
    ``end_of_turn``: tokens that end generation as EOS does (so ``ignore_eos`` and ``min_tokens`` apply)."""
    stop_ids = with_end_of_turn(req.stop_token_ids, end_of_turn, bool(req.ignore_eos))

    def pick(value, default):
        return default if value is None else value

    try:
        return SamplingParams(
            n=pick(req.n, 1), max_tokens=max_tokens, min_tokens=pick(req.min_tokens, 0),
            temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, -1),
            min_p=pick(req.min_p, 0.0), presence_penalty=pick(req.presence_penalty, 0.0),
            frequency_penalty=pick(req.frequency_penalty, 0.0), repetition_penalty=pick(req.repetition_penalty, 1.0),
            seed=req.seed, stop=req.stop, stop_token_ids=stop_ids, ignore_eos=pick(req.ignore_eos, False),
            logprobs=logprobs, include_stop_str_in_output=pick(req.include_stop_str_in_output, False),
        )
    except ValueError as e:
        raise bad_request(str(e), param_of(str(e))) from None


def check_unsupported(req: _GenerationRequest) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")


# --- prompts and messages ----------------------------------------------------------------------------
def _is_token(x) -> bool:
    # an out-of-range integer is still a token id in shape: the engine refuses it with the vocabulary's range
    return (isinstance(x, int) and not isinstance(x, bool)) or isinstance(x, OutOfRange)


def parse_prompt(prompt) -> list[str | list[int]]:
    """A completions prompt as a list of prompts: each a string or a list of token ids."""
    shape = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if prompt is None:
        raise bad_request("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise bad_request(f"prompt must be {shape}, got {type(prompt).__name__}", "prompt")
    if not prompt:
        raise bad_request("prompt is empty: at least one token is needed", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_token(t) for t in prompt):
        return [list(prompt)]
    if all(isinstance(p, list) and all(_is_token(t) for t in p) for p in prompt):
        return [list(p) for p in prompt]
    raise bad_request(f"prompt must be {shape}", "prompt")


def parse_messages(messages, max_messages: int) -> tuple[list[dict], list[ImageRef]]:
    """Chat messages as ``[{"role", "content"}]``, content as the chat template takes it (a string, or text and
    image parts), and the image parts in order; or a 400 naming the bad item."""
    if messages is None:
        raise bad_request("messages is required", "messages")
    if not isinstance(messages, list):
        raise bad_request(f"messages must be a list of message objects, got {type(messages).__name__}", "messages")
    if not messages:
        raise bad_request("messages must not be empty", "messages")
    if len(messages) > max_messages:
        raise bad_request(f"messages holds {len(messages)} messages, the limit is {max_messages}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}", where)
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"{where}.role is required and must be a string", f"{where}.role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        if "content" not in m or (m["content"] is None and role != "assistant"):
            raise bad_request(f"{where}.content is required", f"{where}.content")
        out.append({"role": role, "content": m["content"]})
    try:
        return content.parse_messages(out)
    except content.MediaError as e:
        raise bad_request(str(e), e.param) from None


# --- response pieces ---------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finite(lp: float) -> float:
    # JSON has no -inf; a token the model gave no mass at all gets a very negative number instead
    return lp if math.isfinite(lp) else -9999.0


def completion_logprobs(token_ids, logprobs, token_text, offsets: list[int], top=None) -> dict:
    """The legacy completions logprobs object for some tokens. ``offsets``: where each token starts in the
    returned text (``TextOffsets``); ``top``: per token the (id, logprob) alternatives, best first (None when
    none were asked for); they stay best first, as OpenAI sends them."""
    tops = None
    if top is not None:
        tops = []
        for alts in top:
            d: dict[str, float] = {}
            for i, lp in alts:
                d.setdefault(token_text(i)[0], finite(lp))  # two tokens that look alike: the likelier one
            tops.append(d)
    return {"tokens": [token_text(t)[0] for t in token_ids], "token_logprobs": [finite(lp) for lp in logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids, logprobs, token_text, top=None) -> dict:
    content = []
    for j, (t, lp) in enumerate(zip(token_ids, logprobs)):
        text, raw = token_text(t)
        alts = []
        for i, alp in (top[j] if top is not None else ()):
            atext, araw = token_text(i)
            alts.append({"token": atext, "logprob": finite(alp), "bytes": araw})
        content.append({"token": text, "logprob": finite(lp), "bytes": raw, "top_logprobs": alts})
    return {"content": content}


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"model {name!r} does not exist; this server serves {served!r}", "model", "model_not_found")
