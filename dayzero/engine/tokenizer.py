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
