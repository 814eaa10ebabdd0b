"""The server's pieces without a server: streamed-text hold-back, token bytes for logprobs, admission."""
from __future__ import annotations

import asyncio

import pytest

from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.request import reportable_end
from dayzero.engine.tokenizer import load_tokenizer
from dayzero.server.detokenize import TokenText
from dayzero.server.errors import APIError
from dayzero.server.limits import Admission


class TextStreamer:
    """Deltas of successive cumulative texts, as the engine reports a running output (``reportable_end``);
    the finished output's text is sent whole."""

    def __init__(self, stop=None):
        self.stop, self.sent = stop or [], 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else reportable_end(text, self.sent, self.stop)
        out = text[self.sent:end]
        self.sent = max(self.sent, end)
        return out


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


def test_completions_text_offsets_count_characters_of_the_text(tok):
    """text_offset is where each token starts in the returned text: a byte of a multi-byte character is at
    that character, a token after an invalid byte after its U+FFFD, tokens past a stop string at the end."""
    from dayzero.server.detokenize import TextOffsets

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    ids = list("a你b".encode())
    assert TextOffsets(decode)(ids, "a你b") == [0, 1, 1, 1, 2]
    assert TextOffsets(decode)([0xE4, 0x41, 0x42], "\ufffdAB") == [0, 1, 2]
    assert TextOffsets(decode)(list(b"ab STOP"), "ab ") == [0, 1, 2, 3, 3, 3, 3]
    eos = tok.convert_tokens_to_ids("<|eos|>")
    assert TextOffsets(decode)(list("é".encode()) + [eos], "é") == [0, 0, 1]
    # streamed: the same offsets from the text as it is sent, piece by piece
    offsets = TextOffsets(decode)
    assert offsets(ids[:2], "a") + offsets(ids[2:4], "") + offsets(ids[4:], "你b") == [0, 1, 1, 1, 2]


def test_completion_top_logprobs_stay_best_first():
    from dayzero.server.protocol import completion_logprobs

    def token_text(i):
        return {1: ("a", [97]), 2: ("b", [98]), 3: ("a", [97])}[i]

    lp = completion_logprobs([1], [-0.1], token_text, [0], top=[[(1, -0.1), (2, -1.5), (3, -2.0)]])
    assert list(lp["top_logprobs"][0].items()) == [("a", -0.1), ("b", -1.5)]  # best first; a look-alike keeps the best


class _FakeEngine:
    def __init__(self):
        self.aborted = []

    def abort(self, rid, error=None):
        self.aborted.append(rid)


def test_a_reader_too_far_behind_is_aborted_and_holds_nothing_more():
    from types import SimpleNamespace

    from dayzero.engine.request import CompletionOutput, RequestOutput
    from dayzero.engine.sampling_params import SamplingParams
    from dayzero.server.async_engine import Ended
    from dayzero.server.generation import Prompt, Run
    from dayzero.server.limits import ServerLimits

    recorded = []
    srv = SimpleNamespace(limits=ServerLimits(max_stream_backlog=2), engine=_FakeEngine(), admission=Admission(1, 0),
                          runs=set(), metrics=SimpleNamespace(record=lambda outcome, *a: recorded.append(outcome)))

    async def main():
        await srv.admission.acquire()
        run = Run(srv, None, "cmpl-x", [Prompt([1, 2], None), Prompt([3], None)], SamplingParams(), 0.0)
        run._admitted = run._submitted = True
        step = RequestOutput("cmpl-x-0", None, [], [CompletionOutput(0, "a", [7], None)], False)
        for _ in range(4):  # two outputs (two prompts), two unread tokens each: at the limit, still running
            run.deliver(0, step)
        assert not run.fell_behind and len(run._mailbox) == 4
        run.deliver(1, step)
        assert run.fell_behind and srv.engine.aborted == ["cmpl-x-0", "cmpl-x-1"]
        assert [type(item) for _, item in run._mailbox] == [Ended]  # what it held is dropped
        for _ in range(100):
            run.deliver(0, step)
        assert len(run._mailbox) == 1
        assert srv.admission.running == 0 and recorded == ["aborted"]
        with pytest.raises(APIError) as e:
            async for _ in run.updates():
                pass
        assert "fell 5 tokens behind its stream (the limit is 2 per output)" in e.value.message

    asyncio.run(main())
