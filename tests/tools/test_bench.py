"""``dayzero bench``: in-process on the bundled model, against a real server, from a dataset file, and
the options it refuses. Each run is a handful of short requests."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from dayzero.tools import bench_http
from dayzero.tools.bench import add_parser, main
from dayzero.tools.bench_report import Result, summarize
from dayzero.tools.bench_workload import Job
from dayzero.tools.cli_options import CommandParser, Parser
from tests.server.conftest import API_KEY, ServerProcess


def bench(*argv: str) -> int:
    ap = Parser(prog="dayzero")
    add_parser(ap.add_subparsers(parser_class=CommandParser))
    return main(ap.parse_args(["bench", *argv, "--no-progress"]))


def read(path) -> dict:
    return json.loads(path.read_text())


def assert_ordered(summary: dict) -> None:
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = summary["latency_ms"][name]
        assert s is not None, name
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)


def assert_all_ok(summary: dict, n: int) -> None:
    assert summary["requests"] == {"total": n, "completed": n, "failed": 0, "truncated": 0}
    assert summary["errors"] == [] and summary["cache_empty"] is True
    assert not any(summary["cache_after"].values())


def test_in_process_synthetic_counts_tokens_and_orders_percentiles(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = bench("--device", "cpu", "--num-prompts", "5", "--input-len", "8", "--output-len", "4",
               "--concurrency", "2", "--json", str(out), "--plot", str(png))
    table = capsys.readouterr().out
    assert rc == 0, table
    s = read(out)
    assert_all_ok(s, 5)
    assert s["tokens"] == {"prompt": 5 * 8, "output": 5 * 4, "expected_output": 5 * 4}
    assert [r["output_tokens"] for r in s["per_request"]] == [4] * 5
    assert [r["prompt_tokens"] for r in s["per_request"]] == [8] * 5
    assert_ordered(s)
    # in-process every token is seen at the end of its own step: 4 tokens, 3 gaps
    assert all(len(r["itl_s"]) == 3 and min(r["itl_s"]) > 0 for r in s["per_request"])
    assert s["throughput"]["output_tokens_per_s"] == pytest.approx(20 / s["duration_s"])
    assert "requests (ok / failed / truncated)  5 / 0 / 0" in table
    assert "prompt / output tokens              40 / 20" in table
    assert "cache after the run                 empty" in table
    assert table.rstrip().splitlines()[-1].startswith("cache after the run")  # the table is printed last
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_process_chat_dataset_at_a_request_rate(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hello there"}]},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好 😀"}],
              "max_tokens": 3},
             {"messages": [{"role": "user", "content": "one more"}]}]
    data.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n\n")
    out = tmp_path / "b.json"
    rc = bench("--device", "cpu", "--dataset", str(data), "--output-len", "5", "--request-rate", "20",
               "--json", str(out))
    assert rc == 0, capsys.readouterr()
    s = read(out)
    assert_all_ok(s, 3)
    assert [r["output_tokens"] for r in s["per_request"]] == [5, 3, 5]
    assert s["tokens"]["output"] == 13
    assert all(r["prompt_tokens"] > 5 for r in s["per_request"])  # the chat template is around the content
    assert "Poisson 20 req/s" in s["title"] and "dataset chat.jsonl" in s["title"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("bench-serve"), "--num-cache-blocks", "256", "--max-model-len", "512",
                        api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_against_a_server_streams_every_token(server, endpoint, tmp_path, capsys):
    before = server.metrics()
    out = tmp_path / "b.json"
    rc = bench("--url", server.url, "--api-key", API_KEY, "--endpoint", endpoint, "--num-prompts", "4",
               "--input-len", "12", "--output-len", "5", "--concurrency", "2", "--json", str(out))
    table = capsys.readouterr().out
    assert rc == 0, table + server.log()
    s = read(out)
    assert_all_ok(s, 4)
    assert s["tokens"]["output"] == 4 * 5
    if endpoint == "completions":  # token-id prompts have exactly their length
        assert s["tokens"]["prompt"] == 4 * 12
    assert_ordered(s)
    assert all(len(r["itl_s"]) <= 4 for r in s["per_request"])  # chunks a slow reader gets may merge
    assert "dayzero-default" in s["title"]
    after = server.wait_idle()
    assert after["dayzero_generation_tokens_total"] - before["dayzero_generation_tokens_total"] == 20
    finished = "dayzero_requests_total{outcome=finished}"
    assert after[finished] - before.get(finished, 0) == 4


def test_a_wrong_api_key_is_a_clear_error(server, capsys):
    assert bench("--url", server.url, "--api-key", "wrong", "--num-prompts", "1") == 2
    assert "--api-key" in capsys.readouterr().err


def _one(handler, job: Job) -> Result:
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://bench.test") as c:
            return (await bench_http._one(c, job, "m", {}))[0]

    return asyncio.run(go())


def _sse(*events) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()


def test_a_stream_that_ends_short_is_truncated_and_an_error_is_failed():
    chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    short = _one(lambda req: httpx.Response(200, content=_sse(chunk, last, usage, "[DONE]")), Job(4, text="x"))
    assert short.truncated and not short.error and short.output_tokens == 2
    no_done = _one(lambda req: httpx.Response(200, content=_sse(chunk, last, {**usage, "usage": {
        "prompt_tokens": 3, "completion_tokens": 4}})), Job(4, text="x"))
    assert no_done.truncated
    full = _one(lambda req: httpx.Response(200, content=_sse(chunk, last, {**usage, "usage": {
        "prompt_tokens": 3, "completion_tokens": 2}}, "[DONE]")), Job(2, text="x"))
    assert full.ok and len(full.itl) == 1 and full.ttft is not None
    failed = _one(lambda req: httpx.Response(500, json={"error": {"message": "boom"}}), Job(2, text="x"))
    assert failed.error.startswith("HTTP 500") and not failed.ok
    s = summarize([short, no_done, full, failed], 1.0, None)
    assert s["requests"] == {"total": 4, "completed": 1, "failed": 1, "truncated": 2}
    assert s["tokens"]["output"] == 2 and s["cache_empty"] is None


def test_tpot_and_percentiles_from_known_numbers():
    rs = [Result(5, prompt_tokens=2, output_tokens=5, ttft=0.1 * i, e2e=0.1 * i + 0.4, itl=[0.1] * 4)
          for i in range(1, 11)]
    s = summarize(rs, 2.0, {"cache_blocks_used": 0})
    assert s["latency_ms"]["tpot"]["p50"] == pytest.approx(100.0)  # (e2e - ttft) / (5 - 1)
    assert s["latency_ms"]["ttft"]["p50"] == pytest.approx(550.0)
    assert s["latency_ms"]["ttft"]["p90"] == pytest.approx(910.0)
    assert s["throughput"]["requests_per_s"] == pytest.approx(5.0)
    assert s["throughput"]["total_tokens_per_s"] == pytest.approx(35.0)


@pytest.mark.parametrize("argv, option", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--concurrency", "0"], "--concurrency"),
    (["--output-len", "0"], "--output-len"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--dataset", "no/such/file.jsonl"], "--dataset"),
    (["--url", "127.0.0.1:8000"], "--url"),
], ids=lambda v: v if isinstance(v, str) else "_".join(v))
def test_bad_options_name_the_option(argv, option, capsys):
    assert bench(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and option in err, err


@pytest.mark.parametrize("content, says", [
    (b"\xff\xfe not text", "cannot read it"),
    (b'{"prompt": "ok"}\n{"prompt": \n', "line 2"),
    (b'{"prompt": "ok"}\n{"text": "no prompt"}\n', "line 2"),
    (b'{"prompt": "ok", "max_tokens": 0}\n', "max_tokens"),
    (b"\n\n", "no requests"),
], ids=["not-utf8", "bad-json", "no-prompt", "bad-max-tokens", "empty"])
def test_an_unreadable_dataset_is_refused_before_loading_anything(tmp_path, content, says, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(content)
    assert bench("--dataset", str(data), "--device", "cpu") == 2
    err = capsys.readouterr().err
    assert "--dataset" in err and says in err and "model" not in err, err


def test_chat_messages_need_a_chat_endpoint(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert bench("--dataset", str(data), "--endpoint", "completions", "--device", "cpu") == 2
    assert "--endpoint completions" in capsys.readouterr().err
