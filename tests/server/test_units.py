"""The server's pieces without a server: streamed-text hold-back, token bytes for logprobs, admission."""
from __future__ import annotations

import asyncio

import pytest

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.tokenizer import load_tokenizer
from dayzero.server.detokenize import TextStreamer, TokenText
from dayzero.server.errors import APIError
from dayzero.server.limits import Admission


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL)  # byte-level: one token per UTF-8 byte


def stream_bytes(tok, text: str, stop=None) -> list[str]:
    """Feed ``text`` one byte-token at a time, as the engine reports it, and collect the deltas."""
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text.encode())
    s = TextStreamer(stop)
    out = [s.delta(tok.decode(ids[:k]), finished=False) for k in range(1, len(ids))]
    return out + [s.delta(tok.decode(ids), finished=True)]


@pytest.mark.parametrize("text", ["héllo", "你好世界", "😀👩\u200d👩\u200d👧", "e\u0301a\u0308", "ab\ufffdc"],
                         ids=["latin", "cjk", "emoji-zwj", "combining", "literal-replacement-char"])
def test_streamed_deltas_never_split_a_character(tok, text):
    deltas = stream_bytes(tok, text)
    assert "".join(deltas) == text
    for d in deltas:  # every delta is whole characters: it survives a UTF-8 round trip unchanged
        assert d.encode().decode() == d and ("\ufffd" not in d or "\ufffd" in text)


def test_invalid_bytes_are_sent_once_they_cannot_change(tok):
    ids = [0xE4, 0x41, 0x42]  # a lead byte followed by ASCII: an invalid sequence, then "AB"
    s = TextStreamer()
    got = [s.delta(tok.decode(ids[:k]), finished=False) for k in (1, 2, 3)]
    assert got == ["", "\ufffdA", "B"]


def test_stop_string_prefix_is_held_back():
    s = TextStreamer(["STOP", "xy"])
    assert s.delta("hello S", False) == "hello "
    assert s.delta("hello ST", False) == ""
    assert s.delta("hello STa", False) == "STa"  # not a stop after all
    assert s.delta("hello STax", False) == ""
    assert s.delta("hello STax", True) == "x"  # finished: the engine's final text is sent as it is


def test_token_text_bytes_and_display(tok):
    tt = TokenText(tok)
    assert tt(ord("a")) == ("a", [97])
    assert tt(0xE4) == ("bytes:\\xe4", [0xE4])  # one byte of a multi-byte character
    assert tt(ord(" ")) == (" ", [32])
    text, raw = tt(tok.convert_tokens_to_ids("<|eos|>"))
    assert text == "<|eos|>" and bytes(raw) == b"<|eos|>"
    assert TokenText(None)(5) == ("token_id:5", [])


def test_admission_queue_order_limits_and_close():
    async def main():
        adm = Admission(max_running=1, max_queued=1)
        await adm.acquire()
        waiter = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        assert adm.queued == 1
        with pytest.raises(APIError) as e:
            await adm.acquire()
        assert e.value.status == 429 and "1 requests running (limit 1) and 1 queued (limit 1)" in e.value.message
        adm.release()  # the place passes straight to the waiter
        await waiter
        assert adm.running == 1 and adm.queued == 0
        # a waiter that gives up leaves the queue; one handed a place as it is cancelled passes it on
        gone = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert adm.queued == 0 and adm.running == 1
        late = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        adm.release()
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        assert adm.running == 0 and adm.queued == 0
        # closing refuses new requests and wakes the queued ones with a 503
        await adm.acquire()
        queued = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0)
        adm.close()
        with pytest.raises(APIError) as e:
            await queued
        assert e.value.status == 503
        with pytest.raises(APIError):
            await adm.acquire()
        adm.release()
        assert adm.running == 0

    asyncio.run(main())
