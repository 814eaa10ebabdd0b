"""Tokenizer and generation settings from a checkpoint directory (transformers' loaders).

A checkpoint without tokenizer files still runs: prompts are then given as token ids and outputs carry
token ids with empty text.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger("dayzero")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | Path):
    path = Path(path)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        log.info("no tokenizer files in %s: prompts must be token ids", path)
        return None
    # imported here: transformers is slow to import and only needed for text prompts
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = None
    if (path / "config.json").exists():
        with open(path / "config.json") as f:
            model_type = json.load(f).get("model_type")
    if (path / "tokenizer.json").exists() and model_type not in CONFIG_MAPPING:
        # AutoTokenizer would consult config.json, whose model_type transformers does not know
        return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path))


def generation_eos_ids(path: str | Path, config_eos: tuple[int, ...], tokenizer) -> tuple[int, ...]:
    """EOS ids: generation_config.json first, then the model config, then the tokenizer."""
    gen = Path(path) / "generation_config.json"
    if gen.exists():
        with open(gen) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            return tuple(eos) if isinstance(eos, list) else (eos,)
    if config_eos:
        return config_eos
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return (tokenizer.eos_token_id,)
    return ()


def with_end_of_turn(stop_ids: list[int] | None, end_of_turn: tuple[int, ...], ignore_eos: bool) -> list[int] | None:
    """A chat request's stop token ids: its own, then the template's end-of-turn tokens, which end generation as
    EOS does (so ``ignore_eos`` keeps generating past them)."""
    if not end_of_turn or ignore_eos:
        return stop_ids
    return list(stop_ids or []) + [t for t in end_of_turn if t not in (stop_ids or ())]


def chat_end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    """The special token the chat template closes an assistant turn with (``<|end|>``, ``<|im_end|>``,
    ``<|eot_id|>``, ...), as the template itself writes it: a conversation ending in an assistant message
    is rendered and the token right after that message's content is taken when it is a special token.
    Generation for a chat stops there, as it does at EOS; () when the template shows none."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return ()
    marker = "\x00end-of-turn\x00"
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
    try:
        text = tokenizer.apply_chat_template(conversation, add_generation_prompt=False, tokenize=False)
    except Exception as e:  # a template that wants another conversation shape: no end-of-turn token to add
        log.info("chat template did not render a sample conversation (%s): stopping at EOS only", e)
        return ()
    at = text.find(marker)
    if at < 0:
        return ()
    after = tokenizer.encode(text[at + len(marker):], add_special_tokens=False)
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special |= set(getattr(tokenizer, "all_special_ids", ()) or ())
    return (after[0],) if after and after[0] in special else ()
