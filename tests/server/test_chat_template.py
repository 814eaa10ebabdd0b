"""Chat through the model's own template: generation ends at the template's end-of-turn token, and the
template options of the API are honoured or refused with a 400 naming the field."""
from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, complete_ok

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TEMPLATED = "<|bos|><|user|>hi<|end|><|assistant|>"  # what the bundled template makes of USER


def test_chat_stops_at_the_end_of_turn_token(server):
    """The bundled template closes a turn with <|end|> (its generation config names only <|eos|>). Sampled
    as a plain completion of the templated prompt, some output says <|end|> before any <|eos|>; the same
    draw as a chat ends right there, with finish_reason "stop"."""
    kw = {"n": 8, "max_tokens": 160, "temperature": 1.0}
    for seed in range(6):
        plain = server.post("/v1/completions", {"prompt": TEMPLATED, "seed": seed, "logprobs": 0, "ignore_eos": True, **kw})
        assert plain.status_code == 200, plain.text
        ends = {}
        for c in plain.json()["choices"]:
            tokens = c["logprobs"]["tokens"]
            first = next((i for i, t in enumerate(tokens) if t in ("<|end|>", "<|eos|>")), None)
            if first is not None and tokens[first] == "<|end|>":
                ends[c["index"]] = first
        if ends:
            break
    assert ends, "no sampled output said <|end|> first: the test did not exercise the case"
    chat = server.post(CHAT, {"messages": USER, "seed": seed, "logprobs": True, **kw})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]  # the same prompt
    for c in chat.json()["choices"]:
        if c["index"] in ends:
            content = c["logprobs"]["content"]
            assert c["finish_reason"] == "stop"
            assert len(content) == ends[c["index"]] + 1 and content[-1]["token"] == "<|end|>"
            assert "<|end|>" not in c["message"]["content"]
    # ignore_eos goes past it, as past EOS
    long = server.post(CHAT, {"messages": USER, "seed": seed, "ignore_eos": True, **kw}).json()
    assert all(c["finish_reason"] == "length" for c in long["choices"])
    complete_ok(server)


def _prompt_tokens(server, **body) -> int:
    r = server.post(CHAT, {"model": MODEL, "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_template_options_are_honoured(server):
    with_prompt = _prompt_tokens(server, messages=USER)
    assert with_prompt == len("hi") + 4  # <|bos|> <|user|> h i <|end|> <|assistant|>
    assert _prompt_tokens(server, messages=USER, add_generation_prompt=False) == with_prompt - 1
    partial = [*USER, {"role": "assistant", "content": "Hel"}]
    # the assistant's message is continued: no <|end|> after it, no new <|assistant|>
    assert _prompt_tokens(server, messages=partial, add_generation_prompt=False, continue_final_message=True) == \
        with_prompt + len("Hel")
    assert _prompt_tokens(server, messages=USER, chat_template_kwargs={"enable_thinking": False}) == with_prompt
    assert _prompt_tokens(server, messages=USER, add_special_tokens=True) == with_prompt  # this tokenizer adds none


@pytest.mark.parametrize("body,param,text", [
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "valid boolean"),
    ({"continue_final_message": True}, "continue_final_message", "needs add_generation_prompt to be false"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "needs the last message to be the assistant's"),
    ({"chat_template": "{{ messages }}"}, "chat_template", "chat_template is not accepted"),
    ({"documents": [{"text": "x"}]}, "documents", "documents are not supported"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "'tokenize' is not a template variable"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs", "valid dictionary"),
], ids=["add_generation_prompt-type", "continue-with-generation-prompt", "continue-after-user", "chat_template",
        "documents", "reserved-kwarg", "kwargs-type"])
def test_template_options_refused(server, body, param, text):
    r = server.post(CHAT, {"model": MODEL, "messages": USER, "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and text in err["message"], err
    complete_ok(server)
