"""``dayzero serve --async-scheduling`` (steps overlapped with the host's work) answers exactly as the server that
waits every step: the same greedy and seeded completions, streamed or not, through the official client, and
its cache is empty afterwards."""
from __future__ import annotations

import pytest

from tests.server.conftest import API_KEY, MODEL, ServerProcess

REQUESTS = [dict(prompt="the engine", max_tokens=24, temperature=0.0, ignore_eos=True),
            dict(prompt="hello", max_tokens=16, temperature=0.8, seed=11, n=2),
            dict(prompt="stop here", max_tokens=40, temperature=0.0)]


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory, random_model):
    """The ``server`` fixture's model and options, with overlapped steps."""
    srv = ServerProcess(tmp_path_factory.mktemp("serve-async"), str(random_model), "--served-model-name", MODEL,
                        "--num-cache-blocks", "2048", "--max-model-len", "1024", "--async-scheduling", api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


def completions(srv: ServerProcess, stream: bool) -> list:
    client, out = srv.client(), []
    for kw in REQUESTS:
        extra = {k: kw[k] for k in ("ignore_eos",) if k in kw}
        args = {k: v for k, v in kw.items() if k != "ignore_eos"}
        if not stream:
            r = client.completions.create(model=MODEL, extra_body=extra, **args)
            out.append(sorted((c.index, c.text, c.finish_reason) for c in r.choices))
            continue
        texts, reasons = {}, {}
        for c in client.completions.create(model=MODEL, stream=True, extra_body=extra, **args):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
                reasons[ch.index] = ch.finish_reason or reasons.get(ch.index)
        out.append(sorted((i, texts[i], reasons[i]) for i in texts))
    return out


def test_same_answers_as_the_waiting_server(server, overlapped):
    want = completions(server, stream=False)
    assert completions(overlapped, stream=False) == want
    assert completions(overlapped, stream=True) == want
    assert overlapped.wait_idle()["dayzero_cache_blocks_used"] == 0  # (wait_idle asserts every block and slot free)
