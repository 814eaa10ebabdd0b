"""The same engine on a CUDA device with the reference ops: fp32 greedy outputs equal the CPU's."""
from __future__ import annotations

import pytest
import torch

from dayzero import LLM, SamplingParams
from tests.engine.test_engine import prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_gpu_fp32_greedy_equals_cpu(tiny_ckpt):
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ps = prompts()
    kw = dict(dtype="float32", block_size=4, num_cache_blocks=256)
    cpu = [o.outputs[0].token_ids for o in LLM(str(tiny_ckpt), device="cpu", **kw).generate(ps, sp)]
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = [o.outputs[0].token_ids for o in LLM(str(tiny_ckpt), device="cuda", **kw).generate(ps, sp)]
    assert gpu == cpu


def test_gpu_bf16_runs_and_is_batch_invariant(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cuda", dtype="bfloat16", block_size=4, num_cache_blocks=256)
    assert llm.engine.dtype == torch.bfloat16
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ps = prompts()
    outs = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    assert all(len(o) == 8 for o in outs)
    assert llm.generate([ps[3]], sp)[0].outputs[0].token_ids == outs[3]
