"""The launcher on the CPU with Gloo: ``LLM(tp=2)`` and ``dayzero serve --tp 2`` start their second rank
themselves.

- ``LLM(path, tp=2)``, ``ep=2`` (with redundant experts rebalanced every two steps) and ``pp=2`` give one
  process's greedy tokens and logprobs (the API's logprobs are those of the generated tokens), and the ranks stay
  in step when the driving process draws random numbers between calls;
  ``tp=1`` is the plain engine;
- a rank killed in the middle of a generate fails it, and every later call, within seconds, naming the rank and
  its exit code; a rank failing at start-up makes the driver raise its error; impossible layouts stop before any
  process starts, naming the setting;
- ``dayzero serve --tp 2`` answers through the openai client, and when a rank is killed the request in flight
  gets an error and the server exits with status 1 and the reason.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
import torch

from dayzero import LLM, SamplingParams
from dayzero.engine import worker_main
from dayzero.engine.engine import DEFAULT_MODEL, LLMEngine
from dayzero.engine.workers import EngineDriver, RankFailure
from tests.distributed.test_tensor_parallel import CONFIGS
from tests.hf.harness import make_hf_checkpoint, prompt_batch
from tests.server.conftest import ServerProcess

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_cache_blocks=128, max_num_batched_tokens=64,
              num_threads=1)
RTOL = 1e-4
FAIL_WITHIN = 10.0  # seconds from a rank's death to the error


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> Path:
    """A tiny qwen3_moe model made by transformers, with the bundled tokenizer (for the server)."""
    path = tmp_path_factory.mktemp("launcher") / "qwen3_moe"
    make_hf_checkpoint(path, "qwen3_moe", **CONFIGS["qwen3_moe"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path)
    return path


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("layout", [dict(tp=2), dict(ep=2, num_redundant_experts=4, eplb_interval=2), dict(pp=2)],
                         ids=["tp2", "ep2-balanced", "pp2"])
def test_two_ranks_give_one_process_outputs(qwen3_moe, layout):
    prompts = [{"prompt_token_ids": p} for p in prompt_batch(CONFIGS["qwen3_moe"]["vocab_size"], lengths=(5, 23, 12))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    one = LLM(str(qwen3_moe), **ENGINE)
    assert type(one.engine) is LLMEngine  # tp=1 is the engine it always was
    want = one.generate(prompts, params)
    with LLM(str(qwen3_moe), **layout, **ENGINE) as llm:
        p = llm.engine.parallel
        assert isinstance(llm.engine, EngineDriver) and p.world_size == 2
        assert (p.tp_size, p.ep_size, p.pp_size) == tuple(layout.get(k, 1) for k in ("tp", "ep", "pp"))
        got = llm.generate(prompts, params)
        pids = llm.engine.pids
        torch.manual_seed(1234)  # rank 0 alone draws: each step carries its generator's state to the others
        sampled = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 4 for o in sampled)  # every step's digests agreed
    assert not any(alive(p) for p in pids)
    for w, g in zip(want, got):
        a, b = w.outputs[0], g.outputs[0]
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        lp, ref = torch.tensor(b.logprobs), torch.tensor(a.logprobs)
        assert ((lp - ref).norm() / ref.norm()).item() <= RTOL
        assert [[t for t, _ in top] for top in b.top_logprobs] == [[t for t, _ in top] for top in a.top_logprobs]
        tops, ref_tops = torch.tensor([[v for _, v in top] for top in b.top_logprobs]), \
            torch.tensor([[v for _, v in top] for top in a.top_logprobs])
        assert ((tops - ref_tops).norm() / ref_tops.norm()).item() <= RTOL


def test_a_killed_rank_fails_requests_within_seconds(qwen3_moe):
    llm = LLM(str(qwen3_moe), tp=2, **ENGINE)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    assert len(llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids) == 2
    pid = llm.engine.pids[0]
    died = r"rank 1 \(pid \d+\) died with exit code -9 \(SIGKILL\)"
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()  # while the long request below decodes
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=died):
        llm.generate(prompt, SamplingParams(max_tokens=240, ignore_eos=True))
    assert time.monotonic() - t0 < FAIL_WITHIN
    with pytest.raises(RankFailure, match=died):  # and every later request, at once
        llm.generate(prompt, SamplingParams(max_tokens=2))
    llm.close()
    assert not llm.engine.requests  # the failed requests were aborted on rank 0 too


def rank_with_bad_env(conn, rank, join, parent):
    """A rank whose environment is broken: the real worker, started with a DAYZERO_OPS it refuses."""
    os.environ["DAYZERO_OPS"] = "nonsense"
    worker_main.spawned(conn, rank, join, parent)


def test_startup_failures_name_the_setting(qwen3_moe, monkeypatch):
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        LLM(str(qwen3_moe), tp=3, **ENGINE)
    with pytest.raises(ValueError, match="tp=2 does not divide world_size=3"):
        LLM(str(qwen3_moe), tp=2, ep=3, **ENGINE)
    with pytest.raises(ValueError, match="ep=3 does not divide world_size=4"):
        LLM(str(qwen3_moe), tp=4, ep=3, **ENGINE)
    with pytest.raises(ValueError, match="pp=4 exceeds num_hidden_layers=3"):
        LLM(str(qwen3_moe), pp=4, **ENGINE)
    with pytest.raises(ValueError, match="num_redundant_experts=3 needs expert parallelism and a multiple of ep=2"):
        LLM(str(qwen3_moe), ep=2, num_redundant_experts=3, **ENGINE)
    with monkeypatch.context() as m:  # a host with one GPU
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(ValueError, match="tp=2, ep=1, pp=1: 2 ranks on this host need one CUDA device each, "
                                             "it has 1"):
            LLM(str(qwen3_moe), **{**ENGINE, "device": "cuda"}, tp=2)
    monkeypatch.setattr(worker_main, "spawned", rank_with_bad_env)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"rank 1 failed in startup: OpsOverrideError: DAYZERO_OPS item 'nonsense'"):
        LLM(str(qwen3_moe), tp=2, **ENGINE)
    assert time.monotonic() - t0 < 60


def test_serve_tp2_answers_and_exits_when_a_rank_dies(qwen3_moe, tmp_path):
    srv = ServerProcess(tmp_path, str(qwen3_moe), "--tp", "2", "--threads", "1", "--num-cache-blocks", "128",
                        "--dtype", "float32")
    try:
        client = srv.client(timeout=30.0)
        r = client.completions.create(model="qwen3_moe", prompt="hello", max_tokens=5, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
        pid = int(re.search(r"pids of the others: (\d+)", srv.log()).group(1))
        stream = client.completions.create(model="qwen3_moe", prompt="hello", max_tokens=240, stream=True,
                                           extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="rank 1"):
            for i, _ in enumerate(stream):
                if i == 2:
                    os.kill(pid, signal.SIGKILL)
        assert srv.proc.wait(FAIL_WITHIN) == 1
        assert re.search(r"error: the engine stopped: rank 1 \(pid \d+\) died with exit code -9", srv.log()), srv.log()
    finally:
        srv.stop()
