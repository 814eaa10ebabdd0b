"""Incremental detokenization: at every step the running text is a prefix of the final text and holds what a
whole decode of the tokens so far shows (less a character still arriving), the final text equals the whole
decode, and the work per token stays bounded.

Two tokenizers: the bundled byte-level one (one UTF-8 byte per token, so multi-byte characters arrive over
several tokens) and a SentencePiece-style BPE built here with the ``tokenizers`` library (Metaspace word
boundaries, byte fallback, the leading space stripped by the decoder: the case that needs left context).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dayzero
from dayzero.engine.detokenizer import MAX_PENDING, REPLACEMENT, IncrementalText

TEXT = ("Grüße aus Zürich — 東京の天気は晴れ 🌤️, naïve café. Ünïcödé everywhere: Ωμέγα, Привет, 👍🏽 done.\n"
        "Numbers 3.14159 and tabs\tand   spaces.")


def byte_tokenizer():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(Path(dayzero.__file__).parent / "assets" / "default"))


def sentencepiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"])
    trained.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20 + ["hello world, hello there"] * 20, trainer)
    state = json.loads(trained.to_str())["model"]
    vocab = dict(state["vocab"])
    for b in range(256):  # byte fallback: every byte has its own ordinary token, as Llama-style vocabularies do
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(["<unk>", "</s>"])
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"byte-level": byte_tokenizer, "sentencepiece": sentencepiece_tokenizer}


def stream(tokenizer, ids):
    """(running text after each token, decoder); decode calls counted in ``decoded`` tokens."""
    decoded = [0]

    def decode(x):
        decoded[0] += len(x)
        return tokenizer.decode(x, skip_special_tokens=True)

    inc = IncrementalText(decode)
    texts = []
    for n in range(1, len(ids) + 1):
        inc.update(ids[:n])
        texts.append(inc.text)
    return texts, decoded[0]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_running_text_is_the_whole_decode(name):
    tok = TOKENIZERS[name]()
    ids = tok.encode(TEXT + " the quick brown fox, hello world", add_special_tokens=False)
    assert tok.decode(ids) == TEXT + " the quick brown fox, hello world"
    texts, _ = stream(tok, ids)
    final = tok.decode(ids)
    assert texts[-1] == final
    for n, text in enumerate(texts, 1):
        # never ahead of the final text, never behind what a whole decode of the tokens so far shows cleanly
        # (a byte-fallback decode turns a whole run of bytes into U+FFFD while one character is incomplete)
        clean = tok.decode(ids[:n], skip_special_tokens=True).rstrip(REPLACEMENT)
        assert final.startswith(text) and text.startswith(clean), (n, text, clean)
        if name == "byte-level":  # one byte per token: exactly the whole decode, less the character arriving
            assert text == clean
    if name == "sentencepiece":  # the leading space of a word survives a decode that starts at its token
        assert " quick" in texts[-1] and any(tok.decode(ids[i:i + 1]).startswith("quick") for i in range(len(ids)))


@pytest.mark.parametrize("name", TOKENIZERS)
def test_invalid_utf8_does_not_stall(name):
    """Bytes that never form a character: the tail is taken as it is after MAX_PENDING tokens, so the running
    text keeps up and the decode window stays short."""
    tok = TOKENIZERS[name]()
    lone = tok.convert_tokens_to_ids("<0xC3>") if name == "sentencepiece" else tok.encode("é", add_special_tokens=False)[0]
    word = tok.encode("hello world", add_special_tokens=False)
    ids = (([lone] * 9) + word) * 20
    texts, decoded = stream(tok, ids)
    assert texts[-1].replace(REPLACEMENT, "") == tok.decode(ids).replace(REPLACEMENT, "")
    assert decoded <= 2 * (MAX_PENDING + 1) * len(ids)
    texts, decoded = stream(tok, [lone] * 300)  # every decode ends in U+FFFD
    assert decoded <= 2 * (MAX_PENDING + 1) * 300 and len(texts[-1]) >= 300 - MAX_PENDING


@pytest.mark.parametrize("name", TOKENIZERS)
def test_work_per_token_is_bounded(name):
    """2000 tokens cost a few decoded tokens each, not the whole output each step (~2 million)."""
    tok = TOKENIZERS[name]()
    g = torch.Generator().manual_seed(0)
    base = tok.encode(TEXT, add_special_tokens=False)
    ids = [base[i] for i in torch.randint(0, len(base), (2000,), generator=g).tolist()]
    texts, decoded = stream(tok, ids)
    assert decoded <= 2 * (MAX_PENDING + 1) * len(ids), decoded
    assert len(texts[-1]) >= len(TEXT)  # it kept up (2000 tokens of a text that takes fewer to write)


def test_offset_into_the_whole_token_list():
    """``update(token_ids, prompt_len)`` equals ``update(output_ids)``: the engine passes the sequence's list."""
    tok = byte_tokenizer()
    prompt, out = tok.encode("prompt: ", add_special_tokens=False), tok.encode(TEXT, add_special_tokens=False)
    a, b = IncrementalText(tok.decode), IncrementalText(tok.decode)
    for n in range(1, len(out) + 1):
        assert a.update(prompt + out[:n], len(prompt)) == b.update(out[:n])
    assert a.text == b.text == TEXT
