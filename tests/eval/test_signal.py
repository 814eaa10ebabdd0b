"""The end-to-end signal of ``dayzero eval``: the same held-out instances, answered through engines that differ
only in how they schedule and cache (chunked prefill of 16 tokens, forced preemption, one sequence at a time,
overlapped steps, the second pass served from the prefix cache), give exactly the completions of the plain
fp32 engine. A scheduler that feeds a chunk twice or a prefix cache that restores the wrong state changes them.
Likewise MXFP4 experts give the same completions through the bf16 workspace, the FP8 workspace and read packed
(each holds the MXFP4 values exactly). On the bundled model (fp32, CPU)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from dayzero import LLM
from dayzero.eval.tasks import instances
from dayzero.ops import triton_support
from dayzero.tools.eval_cli import answers, score


@pytest.fixture(scope="module", autouse=True)
def users_cpu_path():
    """The CPU path users get: the suite runs Triton's interpreter for its kernel tests, which would, e.g., convert
    every MXFP4 expert through the interpreted kernel at every step."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_support, "INTERPRET", False)
        yield


@pytest.fixture(scope="module")
def insts():
    llm = LLM(dtype="float32")
    count = lambda text: len(llm.tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    out = []
    for task, n in (("addition", 8), ("subtraction", 4), ("reversal", 6), ("sorting", 4), ("recall", 2)):
        out += instances(task, n, "eval", seed=3, max_digits=5, context_len=160, count=count)
    return out


@pytest.fixture(scope="module")
def plain(insts):
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    return answers(llm, insts)


VARIANTS = {
    "chunked prefill of 16": dict(max_num_batched_tokens=16),
    "forced preemption": dict(num_cache_blocks=64, block_size=8),  # a recall prompt (~400 tokens) takes ~51
    "one sequence at a time": dict(max_num_seqs=1),
    "overlapped steps": dict(async_scheduling=True),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_scheduling_variants_answer_as_the_plain_engine(name, insts, plain):
    llm = LLM(dtype="float32", enable_prefix_caching=False, **VARIANTS[name])
    got = answers(llm, insts)
    assert got == plain
    if name == "forced preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert score(insts, got) == score(insts, plain)


def test_a_second_pass_from_the_prefix_cache_answers_as_the_first(insts, plain):
    llm = LLM(dtype="float32")  # prefix caching on (the default)
    first = answers(llm, insts)
    hits = llm.engine.cache.usage()["prefix_hit_tokens"]
    second = answers(llm, insts)
    assert llm.engine.cache.usage()["prefix_hit_tokens"] > hits  # the second pass reused cached prefixes
    assert first == plain and second == plain


def test_mxfp4_experts_answer_alike_through_each_workspace(insts, tmp_path):
    from dayzero.engine.engine import DEFAULT_MODEL

    mx = tmp_path / "mxfp4"
    done = subprocess.run([sys.executable, "-m", "dayzero", "quantize", str(DEFAULT_MODEL), str(mx), "--format",
                           "mxfp4"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    some = insts[:12]
    got = {mode: answers(LLM(str(mx), dtype="float32", expert_compute=mode), some) for mode in ("bf16", "fp8", "fused")}
    assert got["fp8"] == got["bf16"] and got["fused"] == got["bf16"]
