"""Attention data parallelism on the CPU with Gloo: ``LLM(dp=2, ...)`` runs two replicas that each hold sequences
of their own, and meet only in the routed experts' exchange.

- With the experts spread over every rank (``ep = tp·dp``), without expert parallelism (``ep = 1``: independent
  replicas), with tp=2 replicas (world 4, kimi_linear: MLA, KDA and MoE layers), in expert groups whose expert-TP
  pairs lie inside a replica (tp=2 dp=2 ep=2), with MXFP4 experts (the bundled model) and with redundant experts
  rebalanced every two steps, and over two pipeline stages (with ep=2, the steps whole; without, in micro-batches),
  the greedy tokens and logprobs equal one process's. The prompts end at different steps, so one replica runs steps
  with nothing of its own.
- Requests go to the replica with the fewest unfinished ones; a request the engine refuses is refused before any
  rank sees it, and leaves the replicas as they were; the stats sum the replicas' queues and caches; the same
  prompt sampled on both replicas at once draws other random numbers on each.
- ``dayzero serve --dp 2 --ep 2`` answers a request of three prompts (two replicas compute them) alike, and
  ``/metrics`` counts each replica's requests.
- A rank of the other replica killed mid-run fails the requests of both replicas within seconds, naming it.
- Impossible layouts stop before any process starts, naming the setting.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import httpx
import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.workers import EngineDriver, RankFailure
from dayzero.server.metrics import _EngineCollector
from tests.distributed.test_launcher import ENGINE, FAIL_WITHIN, RTOL, alive
from tests.distributed.test_tensor_parallel import CONFIGS
from tests.hf.harness import make_hf_checkpoint, prompt_batch
from tests.server.conftest import ServerProcess

LENGTHS = (5, 23, 12, 9, 17)
MAX_TOKENS = (6, 2, 5, 1, 4)  # the replicas run out of work at different steps


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("attention_dp")
    out = {"default": DEFAULT_MODEL}
    for name in ("qwen3_moe", "kimi_linear"):
        make_hf_checkpoint(root / name, name, **CONFIGS[name])
        out[name] = root / name
    for name in ("tokenizer.json", "tokenizer_config.json"):  # for the server
        shutil.copy(DEFAULT_MODEL / name, root / "qwen3_moe")
    return out


def _requests(vocab: int):
    prompts = [{"prompt_token_ids": p} for p in prompt_batch(vocab, lengths=LENGTHS)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in MAX_TOKENS]
    return prompts, params


def _vocab(path) -> int:
    import json

    return json.loads((path / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("model,layout", [
    ("qwen3_moe", dict(dp=2, ep=2)),
    ("qwen3_moe", dict(dp=2)),
    ("qwen3_moe", dict(dp=2, ep=2, num_redundant_experts=2, eplb_interval=2)),
    ("default", dict(dp=2, ep=2)),
    ("kimi_linear", dict(tp=2, dp=2, ep=4)),
    ("qwen3_moe", dict(tp=2, dp=2, ep=2)),
    ("kimi_linear", dict(dp=2, ep=2, pp=2)),
    ("qwen3_moe", dict(dp=2, pp=2)),
], ids=["dp2-ep2", "dp2-ep1", "dp2-ep2-balanced", "mxfp4-dp2-ep2", "tp2-dp2-ep4", "tp2-dp2-ep2", "dp2-ep2-pp2",
        "dp2-pp2"])
def test_replicas_give_one_process_outputs(models, model, layout):
    path = models[model]
    prompts, params = _requests(_vocab(path))
    want = LLM(str(path), **ENGINE).generate(prompts, params)
    with LLM(str(path), **layout, **ENGINE) as llm:
        engine = llm.engine
        p = engine.parallel
        assert isinstance(engine, EngineDriver)
        assert (p.tp_size, p.dp_size, p.ep_size) == (layout.get("tp", 1), 2, layout.get("ep", 1))
        got = llm.generate(prompts, params)
        assert not engine.home and not engine.has_unfinished()
        pids = engine.pids
    assert not any(alive(pid) for pid in pids)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert b.token_ids == a.token_ids
        lp, ref = torch.tensor(b.logprobs), torch.tensor(a.logprobs)
        assert ((lp - ref).norm() / ref.norm()).item() <= RTOL
        assert [[t for t, _ in top] for top in b.top_logprobs] == [[t for t, _ in top] for top in a.top_logprobs]


def test_replicas_are_chosen_by_the_cache_their_requests_may_claim(models):
    path = models["qwen3_moe"]
    vocab = _vocab(path)
    long, short = (SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (40, 2))
    with LLM(str(path), dp=2, ep=2, **ENGINE) as llm:
        engine = llm.engine
        a, b, c, d = prompt_batch(vocab, lengths=(4, 6, 8, 5))
        engine.add_request("long", a, long)  # replica 0 may claim 44 tokens
        engine.add_request("s1", b, short)  # replica 1: 8
        engine.add_request("s2", c, short)  # replica 1 again (18 < 44), where a count of requests gives 0
        assert engine.home == {"long": 0, "s1": 1, "s2": 1}
        engine.abort("long")  # its claim goes with it: replica 0 is the emptier one
        engine.add_request("s3", d, short)
        assert engine.home == {"s1": 1, "s2": 1, "s3": 0}
        finished = set()
        while engine.has_unfinished():
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"s1", "s2", "s3"} and engine.home == {} and not engine.requests


def test_requests_go_to_the_emptier_replica_and_refusals_change_nothing(models):
    path = models["qwen3_moe"]
    vocab = _vocab(path)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(str(path), dp=2, ep=2, **ENGINE) as llm:
        engine = llm.engine
        for i, ids in enumerate(prompt_batch(vocab, lengths=(4, 6, 8))):
            engine.add_request(f"r{i}", ids, params)
        assert engine.home == {"r0": 0, "r1": 1, "r2": 0}
        assert set(engine.requests) == {"r0", "r1", "r2"} and engine.requests["r1"][0].num_prompt_tokens == 6
        assert engine.stats()["replica_requests"] == [2, 1]
        scrape = "".join(f"{m.name}{s.labels} {s.value}\n" for m in _EngineCollector(engine.stats, lambda: 0).collect()
                         for s in m.samples)
        assert "dayzero_replica_requests{'replica': '0'} 2" in scrape and "{'replica': '1'} 1" in scrape
        # the next request would go to replica 1: refused on rank 0, it reaches no rank
        with pytest.raises(ValueError, match=r"prompt token ids must be ints in \[0, "):
            engine.add_request("bad", [1, vocab + 5], params)
        with pytest.raises(ValueError, match="request id 'r1' is already in use"):
            engine.add_request("r1", [5, 6], params)
        assert engine.home == {"r0": 0, "r1": 1, "r2": 0}
        assert engine.abort("r1") and not engine.abort("r1") and "r1" not in engine.requests
        finished = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = o.outputs[0].token_ids
        assert sorted(finished) == ["r0", "r2"] and all(len(t) == 3 for t in finished.values())
        # replica 1 idled through those steps; it still serves a request now
        engine.add_request("r3", [7, 8, 9], params)
        engine.add_request("r4", [7, 8, 9], params)
        assert engine.home == {"r3": 0, "r4": 1}
        engine.step()  # prefill both: the counters sum the replicas'
        stats, mine = engine.stats(), engine.engine.stats()
        assert stats["running"] == 2 and mine["running"] == 1
        assert stats["blocks_total"] == 2 * mine["blocks_total"] and stats["aborts"] == mine["aborts"] + 1  # r1
        outs = {}
        while engine.has_unfinished():
            outs |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        assert outs["r3"] == outs["r4"] and len(outs["r3"]) == 3  # the same prompt on either replica
        # sampled: the same prompt at the same batch position of both replicas draws other numbers on each
        hot = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
        torch.manual_seed(7)
        a, b = llm.generate([{"prompt_token_ids": [7, 8, 9]}] * 2, hot)
        assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_a_killed_replica_fails_every_request_within_seconds(models):
    llm = LLM(str(models["qwen3_moe"]), dp=2, ep=2, **ENGINE)
    pid = llm.engine.pids[0]
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]  # one on each replica
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 \(pid \d+\) died with exit code -9 \(SIGKILL\)"):
        llm.generate(prompts, SamplingParams(max_tokens=240, ignore_eos=True))
    assert time.monotonic() - t0 < FAIL_WITHIN
    llm.close()
    assert not llm.engine.requests and not llm.engine.home  # the failed requests were aborted on both replicas


@pytest.mark.parametrize("layout,message", [
    (dict(dp=2, ep=2, pp=2, pp_micro_batches=2), "pp_micro_batches=2 with dp=2 and ep=2: replicas cut their steps "
                                                   "into different numbers of parts"),
    (dict(dp=4, ep=2), r"ep=2 with dp=4: attention data parallelism takes ep=1 .*, ep=tp·dp=4 .*, or an ep whose "
                       r"expert-TP groups of tp·dp/ep=2 ranks lie inside a replica of tp=1"),
    (dict(tp=2, dp=2, ep=8), "dp=2 replicas of tp=2 ranks are 4 ranks, not world_size=8"),
    (dict(dp=0), "dp must be a positive int, got 0"),
])
def test_impossible_layouts_name_the_setting(models, layout, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(models["qwen3_moe"]), **layout, **ENGINE)


def test_serve_dp2_answers_from_both_replicas(models, tmp_path):
    srv = ServerProcess(tmp_path, str(models["qwen3_moe"]), "--dp", "2", "--ep", "2", "--threads", "1",
                        "--num-cache-blocks", "128", "--dtype", "float32")
    try:
        client = srv.client(timeout=60.0)
        r = client.completions.create(model="qwen3_moe", prompt=["hello there"] * 3, max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 15 and len({c.text for c in r.choices}) == 1
        metrics = httpx.get(f"{srv.url}/metrics", timeout=10.0).text
        assert 'dayzero_replica_requests{replica="1"} 0.0' in metrics
    finally:
        srv.stop()
