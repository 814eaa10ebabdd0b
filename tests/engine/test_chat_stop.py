"""The token a chat template closes an assistant turn with, read from the template itself."""
from __future__ import annotations

import copy

import pytest

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.tokenizer import chat_end_of_turn_ids, load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)


def with_template(tok, template: str):
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def test_the_bundled_template_ends_turns_with_end(tok):
    assert chat_end_of_turn_ids(tok) == (tok.convert_tokens_to_ids("<|end|>"),)


@pytest.mark.parametrize("template,expected", [
    # ChatML-like: a special token, then a newline
    ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>\n{% endfor %}", "<|eos|>"),
    # the turn ends with plain text: no token to stop at
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}", None),
    # a template that refuses the sample conversation
    ("{{ raise_exception('only one message') if messages | length > 1 }}", None),
], ids=["special-then-newline", "plain-text", "template-raises"])
def test_end_of_turn_from_other_templates(tok, template, expected):
    want = (tok.convert_tokens_to_ids(expected),) if expected else ()
    assert chat_end_of_turn_ids(with_template(tok, template)) == want


def test_no_template_no_tokenizer(tok):
    assert chat_end_of_turn_ids(None) == ()
    assert chat_end_of_turn_ids(with_template(tok, None)) == ()
