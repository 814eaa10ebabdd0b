"""The end-to-end signal of ``dayzero eval``: the same held-out instances, answered through engines that differ
only in how they schedule and cache (chunked prefill of 16 tokens, forced preemption, one sequence at a time,
overlapped steps, the second pass served from the prefix cache, two tensor-parallel ranks, two attention
data-parallel replicas), give exactly the
completions of the plain fp32 engine. A scheduler that feeds a chunk twice or a prefix cache that restores the
wrong state changes them. Likewise MXFP4 experts give the same completions through the bf16 workspace, the FP8
workspace and read packed (each holds the MXFP4 values exactly). On the bundled model (fp32, CPU)."""
from __future__ import annotations

import json

import pytest

from dayzero import LLM
from dayzero.engine.engine import DEFAULT_MODEL
from dayzero.engine.tokenizer import load_tokenizer
from dayzero.eval.modes import MODES, run_mode
from dayzero.eval.tasks import instances
from dayzero.tools.eval_cli import answers, max_answer_tokens, score


@pytest.fixture(scope="module")
def count():
    """A text's tokens under the bundled model's tokenizer."""
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def insts(count):
    out = []
    for task, n in (("addition", 8), ("subtraction", 4), ("reversal", 6), ("sorting", 4), ("recall", 2)):
        out += instances(task, n, "eval", seed=3, max_digits=5, context_len=160, count=count)
    return out


PLAIN = dict(dtype="float32", enable_prefix_caching=False)


@pytest.fixture(scope="module")
def plain(insts):
    return answers(LLM(**PLAIN), insts)


@pytest.mark.parametrize("name", ["chunk16", "preempt", "batch1", "async", "prefix", "tp2", "dp2"])
def test_scheduling_modes_answer_as_the_plain_engine(name, insts, plain, count):
    """``dayzero eval --modes``'s rescheduling modes over the plain fp32 engine: the same completions."""
    run = run_mode(MODES[name], PLAIN, insts, answers, max_answer_tokens, count)
    assert run.texts == plain
    assert score(insts, run.texts) == score(insts, plain)
    if name == "preempt":  # the cache held a few sequences: the scheduler had to preempt
        assert run.preemptions > 0
    if name == "prefix":  # the scored second pass reused the first's cached prefixes
        assert run.prefix_hit > 0.2


def test_mxfp4_experts_answer_alike_through_each_workspace(insts, count):
    """The bundled model's routed experts are stored MXFP4: the default (read packed in small steps), either
    workspace and always packed give the same completions."""
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"
    some, base = insts[:12], dict(model=str(DEFAULT_MODEL), dtype="float32")
    got = {m: run_mode(MODES[m], base, some, answers, max_answer_tokens, count).texts
           for m in ("default", "bf16-workspace", "fp8-workspace", "fused-mxfp4")}
    assert all(got[m] == got["default"] for m in ("bf16-workspace", "fp8-workspace", "fused-mxfp4"))
